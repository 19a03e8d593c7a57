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

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from .compile import EAGER_WHILE_TRAINING, tracker_of
from .options import takes_options
from .payoff import TrainingForwardHook
from .strategy import RegionalCompileBase

#: Fabric's checkpoints carry no compile artifacts: nothing to trust.
FABRIC_EXCLUDED = ("trust_unsigned_artifacts",)


class RegionalCompileFabricMixin(RegionalCompileBase, FabricStrategy):
    """Compiles the module's regions in place in ``setup_module``; reports after the
    first optimizer step. Mixed in before a Fabric strategy class; takes the regional
    options (as the Trainer's ``RegionalCompileStrategy``, but for
    ``trust_unsigned_artifacts``: Fabric's checkpoints carry no compile artifacts) and
    the Fabric strategy's own arguments, all keyword-only."""

    _module: nn.Module | None = None
    _timing_hook: RemovableHandle | None = None
    excluded_options = FABRIC_EXCLUDED
    #: Fabric has no teardown at the end of a loop: the gate's eager turns run training
    #: calls alone eager, so a loop that stops mid-turn evaluates compiled.
    EAGER_TURN = EAGER_WHILE_TRAINING

    @override
    def setup_module(self, module: nn.Module) -> Any:
        self.compile_in_place(module, root_is_called=True)  # the loop calls the module
        self._module = module
        return super().setup_module(module)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self._module is not None:
            # Fabric's loop is the user's: the phase is what ran since the last step.
            phase = "the calls since the last optimizer step"
            self.at_step_boundary(self._module, phase)
            if self.payoff is not None and self.payoff.decision is None:
                self._time_forwards(self._module)
            else:
                self._stop_timing_forwards()
        return output

    def _time_forwards(self, module: nn.Module) -> None:
        """While the keep-or-revert gate times steps, each starts at the module's first
        forward with grad after an optimizer step (what the loop ran before it, its
        validation, is not in the step): a hook of ours, on the module until the
        decision or teardown. Not where the module is itself a region (no repeated
        blocks): a hook added to a compiled call would recompile it; there a step is
        timed from the last optimizer step."""
        tracker = tracker_of(module)
        if self._timing_hook is not None or tracker is None:
            return
        if any(region.module is module for region in tracker.plan.regions):
            return
        assert self.payoff is not None  # timing
        self._timing_hook = module.register_forward_pre_hook(TrainingForwardHook(self.payoff))

    def _stop_timing_forwards(self) -> None:
        if self._timing_hook is not None:
            self._timing_hook.remove()
            self._timing_hook = None

    @override
    def teardown(self) -> None:
        super().teardown()
        self._stop_timing_forwards()
        self.leave_parts()


@takes_options(FABRIC_EXCLUDED, base=FabricSingleDeviceStrategy.__init__)
class RegionalCompileStrategy(RegionalCompileFabricMixin, FabricSingleDeviceStrategy):
    """Fabric on one device with the module's repeated blocks compiled in place.

    Takes the regional options and ``SingleDeviceStrategy``'s ``device``,
    ``accelerator``, ``checkpoint_io``, ``precision``, all keyword-only.

    Args:
    """

    strategy_name = "regional_compile"
    description = "Fabric, single device, repeated blocks compiled in place"


@takes_options(FABRIC_EXCLUDED, base=FabricDDPStrategy.__init__)
class RegionalCompileDDPStrategy(RegionalCompileFabricMixin, FabricDDPStrategy):
    """Fabric DDP with each process's repeated blocks compiled in place before DDP wraps.

    Takes the regional options and every argument of Fabric's ``DDPStrategy``
    (``process_group_backend``, ``start_method``...), all keyword-only.

    Args:
    """

    strategy_name = "regional_compile_ddp"
    description = "Fabric DDP, repeated blocks compiled in place in each process"
    wraps_in_ddp = True


def register() -> None:
    """Make ``"regional_compile"`` and ``"regional_compile_ddp"`` Fabric strategy names."""
    RegionalCompileStrategy.register_strategies(STRATEGY_REGISTRY)
    RegionalCompileDDPStrategy.register_strategies(STRATEGY_REGISTRY)


register()
