"""A region's ways to run, switched in place in its call slot: its compiled call, eager,
eager for training calls alone, or another compiled call made for training calls (a
candidate of the keep-or-revert gate). ``RegionCalls`` is one region's; the tracker holds
one per region compiled in place (``core.compile.use_region_calls`` switches them all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from ..compat import FORWARD, dynamo_original_callable
from .trampolines import CompiledForward

#: The names of a region's own ways to run, beside the calls ``RegionCalls.add`` adds:
#: its compiled call, eager, and eager for training calls alone (the others compiled).
COMPILED, EAGER, EAGER_WHILE_TRAINING = "compiled", "eager", "eager while training"


class WhileTraining:
    """A region's call that runs ``training`` where autograd records (a training step)
    and ``otherwise`` elsewhere (validation, generation, ``no_grad``)."""

    def __init__(self, training: Callable[..., Any], otherwise: Callable[..., Any]) -> None:
        self.training = training
        self.otherwise = otherwise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.training if torch.is_grad_enabled() else self.otherwise
        return call(*args, **kwargs)


def _uncompiled(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """What ``torch.compile`` compiled into ``compiled``."""
    return cast(Callable[..., Any], dynamo_original_callable(compiled))


def for_training(call: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    """A region's call that runs ``make(entry)`` for training calls, where ``entry`` is
    what its compiled ``call`` compiled, and ``call`` for the others."""
    if isinstance(call, CompiledForward):
        training = make(_uncompiled(call.compiled))
        return CompiledForward(call.module, WhileTraining(training, call.compiled))
    return WhileTraining(make(_uncompiled(call)), call)


class RegionCalls:
    """Where one region's call lives (``slot[key]``: a module's ``__dict__`` and its
    compiled-call slot, or its ``forward`` for a compiled forward alone), its compiled
    call, and the other calls added by name."""

    def __init__(self, slot: dict[str, Any], key: str, compiled: Any) -> None:
        self.slot = slot
        self.key = key
        self.compiled = compiled
        self._added: dict[str, Any] = {}

    def add(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Keep ``make(entry)`` (``entry``: what the compiled call compiled) as ``name``,
        for training calls; calls outside training keep the compiled call."""
        self._added[name] = for_training(self.compiled, make)

    def use(self, name: str) -> None:
        """Put ``name``'s call in the slot: ``COMPILED``, ``EAGER`` (the compiled call set
        aside), ``EAGER_WHILE_TRAINING`` or a name given to ``add``."""
        if name == COMPILED:
            self.slot[self.key] = self.compiled
        elif name == EAGER_WHILE_TRAINING:
            self.slot[self.key] = for_training(self.compiled, lambda entry: entry)
        elif name != EAGER:
            self.slot[self.key] = self._added[name]
        elif self.key == FORWARD:  # a compiled forward (eager_hooks): the class's again
            self.slot.pop(FORWARD, None)
        else:
            self.slot[self.key] = None
