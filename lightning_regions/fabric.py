"""Lightning Fabric glue: the regional strategies for Fabric loops.

``fabric.setup(model, optimizer)`` converts the module's precision, moves it to the
device (``module_to_device``, unless ``move_to_device=False``), then calls
``setup_module``, where DDP wraps it. Regions are compiled in place at the start of
``setup_module``: it runs in both cases, after device placement when there is one, and
before any wrapper. The optimizer already exists, but in-place compilation keeps every
``Parameter``, so it holds the right objects. After the first ``optimizer.step()`` the
strategy logs the same one-line summary as the Trainer strategies and ends observation.

Importing this module registers ``"regional_compile"`` and ``"regional_compile_ddp"`` in
Fabric's strategy registry: ``Fabric(strategy="regional_compile")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from torch import nn

from .strategy import RegionalCompileBase


class RegionalCompileFabricMixin(RegionalCompileBase):
    """Compiles the module's regions in place in ``setup_module``; reports after the
    first optimizer step. Mixed in before a Fabric strategy class, whose own arguments
    pass through ``**kwargs``.

    Args:
        backend, mode, fullgraph, dynamic, options, regions, on_compile_error,
            recompile_warn_threshold, cache_dir, disable_training_kv_cache,
            unspecialize_module_ints, granularity: as for the Trainer's
            ``lightning_regions.RegionalCompileStrategy``.
        **kwargs: the Fabric strategy's own arguments.
    """

    strategy_name: str
    description: str
    _module: nn.Module | None = None

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        regions: str | list[str] | None = None,
        on_compile_error: Literal["raise", "eager"] = "raise",
        recompile_warn_threshold: int | Literal["auto"] | None = "auto",
        cache_dir: str | None = None,
        disable_training_kv_cache: bool = True,
        unspecialize_module_ints: bool = True,
        granularity: Literal["regions", "nested"] = "regions",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_regional(
            backend,
            mode,
            fullgraph,
            dynamic,
            options,
            regions,
            on_compile_error,
            recompile_warn_threshold,
            cache_dir,
            disable_training_kv_cache=disable_training_kv_cache,
            unspecialize_module_ints=unspecialize_module_ints,
            granularity=granularity,
        )

    def setup_module(self, module: nn.Module) -> Any:
        self.compile_in_place(module, root_is_called=True)  # the loop calls the module
        self._module = module
        return super().setup_module(module)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        if self._module is not None:
            # Fabric's loop is the user's: the phase is what ran since the last step.
            self.after_optimizer_step(self._module, "the calls since the last optimizer step")
        return output

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.description, override=True
        )


class RegionalCompileStrategy(RegionalCompileFabricMixin, FabricSingleDeviceStrategy):
    """Fabric on one device with the module's repeated blocks compiled in place.

    Takes the regional arguments (see ``RegionalCompileFabricMixin``) and
    ``SingleDeviceStrategy``'s ``device``, ``accelerator``, ``checkpoint_io``, ``precision``.
    """

    strategy_name = "regional_compile"
    description = "Fabric, single device, repeated blocks compiled in place"


class RegionalCompileDDPStrategy(RegionalCompileFabricMixin, FabricDDPStrategy):
    """Fabric DDP with each process's repeated blocks compiled in place before DDP wraps.

    Takes the regional arguments (see ``RegionalCompileFabricMixin``) and every argument
    of Fabric's ``DDPStrategy`` (``process_group_backend``, ``start_method``...).
    """

    strategy_name = "regional_compile_ddp"
    description = "Fabric DDP, repeated blocks compiled in place in each process"


def register() -> None:
    """Make ``"regional_compile"`` and ``"regional_compile_ddp"`` Fabric strategy names."""
    RegionalCompileStrategy.register_strategies(STRATEGY_REGISTRY)
    RegionalCompileDDPStrategy.register_strategies(STRATEGY_REGISTRY)


register()
