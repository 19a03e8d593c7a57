"""Lightning glue: strategies that compile regions in place inside ``model_to_device``.

``model_to_device`` is the one hook every Lightning strategy calls once per ``setup``.
Right after ``super().model_to_device()`` the model is on its device and in its
precision, DDP has not wrapped it yet and no optimizer holds its parameters, so
in-place compilation changes nothing those later steps see but the forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch._dynamo.eval_frame import OptimizedModule

from .compile import compile_regions, validate_compile_arguments
from .regions import Selectors
from .report import RegionNotCompiledWarning, region_report, warn_if_not_compiled


class RegionalCompileMixin:
    """Compiles the LightningModule's regions in place after device placement.

    Mixed into a Lightning strategy before the strategy class, so ``model_to_device``
    and ``optimizer_step`` wrap the strategy's own.
    """

    lightning_module: Any
    model: Any

    def _init_regional(
        self,
        backend: str | Callable[..., Any],
        mode: str | None,
        fullgraph: bool,
        dynamic: bool | None,
        options: dict[str, Any] | None,
        regions: Selectors,
    ) -> None:
        validate_compile_arguments(backend, mode, options)
        self.compile_kwargs: dict[str, Any] = {
            "backend": backend,
            "fullgraph": fullgraph,
            "dynamic": dynamic,
            **({"mode": mode} if mode is not None else {}),
            **({"options": options} if options is not None else {}),
        }
        self.regions = regions
        self._runtime_reported = False

    def model_to_device(self) -> None:
        super().model_to_device()  # type: ignore[misc]
        module = self.lightning_module
        _refuse_whole_model_compile(module)
        compile_regions(module, inplace=True, regions=self.regions, **self.compile_kwargs)
        report = region_report(module)
        rank_zero_info(f"{report}")
        self._runtime_reported = False

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        if not self._runtime_reported:
            self._runtime_reported = True
            report = region_report(self.lightning_module)
            rank_zero_info(runtime_summary(report))
            with warnings.catch_warnings():
                warnings.simplefilter("always", RegionNotCompiledWarning)
                warn_if_not_compiled(report)
        return output


def runtime_summary(report: Any) -> str:
    """One line from torch's own counters, taken after the first optimizer step."""
    counters = torch._dynamo.utils.counters
    graph_breaks = sum(counters["graph_break"].values())
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    return (
        f"regional compile after first step: {report.graphs} graph(s) compiled, "
        f"{recompiles} recompile(s), {graph_breaks} graph break(s), "
        f"{report.compile_seconds:.2f}s in the backend, "
        f"{len(report.never_ran_compiled)} region(s) without a compiled call"
    )


def _refuse_whole_model_compile(module: Any) -> None:
    if isinstance(module, OptimizedModule) or getattr(module, "_compiler_ctx", None):
        raise ValueError(
            f"{type(module).__name__} was passed wrapped by torch.compile. Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )
    if module._compiled_call_impl is not None:
        raise ValueError(
            f"{type(module).__name__} was compiled whole with .compile(). Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )


class RegionalCompileStrategy(RegionalCompileMixin, SingleDeviceStrategy):
    """Single-device training with the LightningModule's repeated blocks compiled in place.

    Args:
        backend: ``torch.compile`` backend name or callable.
        mode: inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...).
        fullgraph: require each region to compile into one graph.
        dynamic: ``torch.compile``'s dynamic-shape setting.
        options: inductor options (not together with ``mode``).
        regions: class names and/or path globs; default: repeated blocks.
        accelerator: passed to ``SingleDeviceStrategy``.
        checkpoint_io: passed to ``SingleDeviceStrategy``.
        precision_plugin: passed to ``SingleDeviceStrategy``.

    The device is the Trainer's (``accelerator=`` and ``devices=``). More than one
    device raises: use ``RegionalCompileDDPStrategy`` (``"regional_compile_ddp"``).
    """

    strategy_name = "regional_compile"

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        regions: str | list[str] | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device="cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._init_regional(backend, mode, fullgraph, dynamic, options, regions)
        self._device_from_trainer: torch.device | None = None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Set by the Trainer's accelerator connector from ``accelerator=``/``devices=``."""
        return None if self._device_from_trainer is None else [self._device_from_trainer]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"RegionalCompileStrategy runs on one device, but the Trainer asks for "
                f"{len(devices)} ({devices}). For several devices use "
                "RegionalCompileDDPStrategy, or strategy='regional_compile_ddp'."
            )
        self._device_from_trainer = devices[0]
        self._root_device = devices[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Single device, repeated blocks compiled in place",
            override=True,
        )


class RegionalCompileDDPStrategy(RegionalCompileMixin, DDPStrategy):
    """Multi-process DDP with each process's repeated blocks compiled in place.

    Regions are compiled after the model is on its device and before DDP wraps it.

    Args:
        backend: ``torch.compile`` backend name or callable.
        mode: inductor mode.
        fullgraph: require each region to compile into one graph.
        dynamic: ``torch.compile``'s dynamic-shape setting.
        options: inductor options (not together with ``mode``).
        regions: class names and/or path globs; default: repeated blocks.
        **kwargs: every ``DDPStrategy`` argument (``process_group_backend``,
            ``start_method``, ``find_unused_parameters``...).
    """

    strategy_name = "regional_compile_ddp"

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        regions: str | list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_regional(backend, mode, fullgraph, dynamic, options, regions)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP, repeated blocks compiled in place in each process",
            override=True,
        )


def register() -> None:
    """Make ``"regional_compile"`` and ``"regional_compile_ddp"`` Trainer strategy names."""
    RegionalCompileStrategy.register_strategies(StrategyRegistry)
    RegionalCompileDDPStrategy.register_strategies(StrategyRegistry)
