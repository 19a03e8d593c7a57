"""Lightning Fabric glue: the regional strategies for Fabric loops.

``fabric.setup(model, optimizer)`` converts the module's precision, moves it to the
device (``module_to_device``, unless ``move_to_device=False``), then calls
``setup_module``, where DDP wraps it. Regions are compiled in place at the start of
``setup_module``: it runs in both cases, after device placement when there is one, and
before any wrapper. The optimizer already exists, but in-place compilation keeps every
``Parameter``, so it holds the right objects. After the first ``optimizer.step()`` the
strategy logs the same one-line summary as the Trainer strategies and ends observation.
A loop may set up several modules (a GAN's generator and discriminator, each with its
optimizer): each is compiled, reported and timed, and one step is one step of them all.

Importing this module registers ``"regional_compile"`` and ``"regional_compile_ddp"`` in
Fabric's strategy registry: ``Fabric(strategy="regional_compile")``.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ..core.calls import EAGER_WHILE_TRAINING
from ..core.compile import tracker_of
from ..gate.gate import TrainingForwardHook
from ..options import takes_options
from .trainer import RegionalCompileBase

#: Fabric's checkpoints carry no compile artifacts: nothing to trust.
FABRIC_EXCLUDED = ("trust_unsigned_artifacts",)


class OptimizerRound:
    """A loop's step as a round of its optimizers: a round ends once every optimizer that
    steps in the loop has stepped since the last round ended (a GAN's generator and
    discriminator steps are one step; a critic stepped 5 times a generator step, too).
    An optimizer counts from its first step until it is garbage, or until another steps
    ``STALE_AFTER`` times in one round without it: one set up and never stepped, or
    replaced by a new one, holds no round back for long."""

    #: Steps of one optimizer in one round after which those absent from it stop counting.
    STALE_AFTER = 32

    def __init__(self) -> None:
        self.stepping: weakref.WeakSet[Any] = weakref.WeakSet()
        self.since_round: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def stepped(self, optimizer: Any) -> bool:
        """``optimizer`` stepped: whether that ends a round."""
        self.stepping.add(optimizer)
        self.since_round[optimizer] = self.since_round.get(optimizer, 0) + 1
        if self.since_round[optimizer] > self.STALE_AFTER:  # the absent ones stepped no more
            self.stepping = weakref.WeakSet(self.since_round)
        if len(self.since_round) < len(self.stepping):  # one is a subset of the other
            return False
        self.since_round = weakref.WeakKeyDictionary()
        return True


class RegionalCompileFabricMixin(RegionalCompileBase, FabricStrategy):
    """Compiles the module's regions in place in ``setup_module``; reports after the
    first optimizer step. Mixed in before a Fabric strategy class; takes the regional
    options (as the Trainer's ``RegionalCompileStrategy``, but for
    ``trust_unsigned_artifacts``: Fabric's checkpoints carry no compile artifacts) and
    the Fabric strategy's own arguments, all keyword-only."""

    #: The modules set up (a GAN's two, each with its optimizer), in order.
    _modules: tuple[nn.Module, ...] = ()
    _timing_hooks: tuple[RemovableHandle, ...] = ()
    #: The optimizers' steps since the last step boundary (made at the first step).
    _round: OptimizerRound | None = None
    excluded_options = FABRIC_EXCLUDED
    #: Fabric has no teardown at the end of a loop: the gate's eager turns run training
    #: calls alone eager, so a loop that stops mid-turn evaluates compiled.
    EAGER_TURN = EAGER_WHILE_TRAINING

    @override
    def setup_module(self, module: nn.Module) -> Any:
        if self.options.compile_in_background and any(m is not module for m in self._modules):
            raise ValueError(
                f"{type(self).__name__}(compile_in_background=True) compiles one module in "
                f"one child process, and {type(self._modules[0]).__name__} is already set "
                f"up; setting up {type(module).__name__} too would leave one of them eager. "
                "Set them up as one module (fabric.setup(nn.ModuleDict({'generator': ..., "
                "'discriminator': ...}), *optimizers)), or pass compile_in_background=False."
            )
        self.compile_in_place(module, root_is_called=True)  # the loop calls the module
        if all(m is not module for m in self._modules):
            self._modules += (module,)
        return super().setup_module(module)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """A step boundary once every optimizer that steps in this loop has stepped since
        the last one (``OptimizerRound``): a GAN's generator and discriminator steps are
        one step, not two of two ways."""
        output = super().optimizer_step(optimizer, **kwargs)
        if self._round is None:
            self._round = OptimizerRound()
        if not self._round.stepped(optimizer):
            return output  # another optimizer's step is still to come in this one
        if self._modules:
            # Fabric's loop is the user's: the phase is what ran since the last step.
            phase = "the calls since the last optimizer step"
            self.at_step_boundary(*self._modules, phase=phase)
            if self.payoff is not None and self.payoff.decision is None:
                self._time_forwards()
            else:
                self._stop_timing_forwards()
        return output

    def _time_forwards(self) -> None:
        """While the keep-or-revert gate times steps, each starts at the first forward
        with grad of a module set up, after the step boundary (what the loop ran before
        it, its validation, is not in the step): a hook of ours, on each module until the
        decision or teardown. Not on a module that is itself a region (no repeated
        blocks): a hook added to a compiled call would recompile it; where no module
        takes one, a step is timed from the last boundary."""
        if self._timing_hooks:
            return
        assert self.payoff is not None  # timing
        hooks = []
        for module in self._modules:
            tracker = tracker_of(module)
            if tracker is None or any(r.module is module for r in tracker.plan.regions):
                continue
            hook = TrainingForwardHook(self.payoff)
            hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        self._timing_hooks = tuple(hooks)

    def _stop_timing_forwards(self) -> None:
        for hook in self._timing_hooks:
            hook.remove()
        self._timing_hooks = ()

    @override
    def teardown(self) -> None:
        super().teardown()
        self._stop_timing_forwards()
        self._round = None
        self._modules = ()
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
