"""The tie check: aliases and tied parameters must survive setup and the first step.

One core, ``TieCheck``: record a module's alias and tie groups, later verify that each
is still one object, held once by the optimizers, with equal values. Two ways in:

- ``TiedWeightsCheck``, a Trainer callback: records in ``Callback.setup`` (before any
  strategy moves, converts or compiles the module) and verifies after the first
  optimizer step. It works with any strategy.
- ``TieCheck`` itself, for loops without callbacks (Fabric): record before
  ``fabric.setup``, call ``verify(model, optimizer)`` after the first ``optimizer.step()``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..core.graph import ModuleGraph, snapshot
from ..lightning_compat import fabric_original_module


class TiedWeightsError(RuntimeError):
    """Aliases or tied parameters recorded before setup are no longer shared."""


@dataclass(frozen=True)
class BrokenGroup:
    kind: Literal["module alias", "tied parameter"]
    paths: tuple[str, ...]
    problem: str

    def __str__(self) -> str:
        return f"{self.kind} {' = '.join(self.paths)}: {self.problem}"


def check_ties(
    recorded: ModuleGraph, live: ModuleGraph, optimizer_params: Iterable[torch.Tensor]
) -> list[BrokenGroup]:
    """Every recorded group that is no longer one object, or whose parameter the
    optimizers hold twice or hold in a stale form.

    A tied parameter that no optimizer holds is fine (frozen weights, LoRA, a
    trainable-only optimizer, ``BackboneFinetuning``), unless it is trainable and an
    optimizer still holds the object recorded at one of its paths, which is no longer
    there: it was replaced after the optimizer was built, so training updates a copy.
    """
    broken = []
    for group in recorded.own_alias_groups():
        objects = {id(live.modules.get(path)) for path in group}
        missing = [path for path in group if live.modules.get(path) is None]
        if missing:
            broken.append(BrokenGroup("module alias", group, f"paths gone: {missing}"))
        elif len(objects) > 1:
            broken.append(BrokenGroup("module alias", group, f"{len(objects)} distinct modules"))
    held = Counter(id(param) for param in optimizer_params)
    for group in recorded.own_tie_groups():
        found = [live.parameters.get(path) for path in group]
        gone = [path for path, p in zip(group, found, strict=True) if p is None]
        if gone:
            broken.append(BrokenGroup("tied parameter", group, f"paths gone: {gone}"))
            continue
        params = [p for p in found if p is not None]
        distinct = {id(p): p for p in params}
        problems = []
        if len(distinct) > 1:
            equal = all(torch.equal(params[0].detach().cpu(), p.detach().cpu()) for p in params)
            problems.append(
                f"{len(distinct)} distinct Parameters (values {'equal' if equal else 'differ'})"
            )
        for path, param in zip(group, params, strict=True):
            before = recorded.parameters[path]
            if held[id(param)] > 1:
                problems.append(f"in the optimizer {held[id(param)]} times")
            elif (
                held[id(param)] == 0
                and param.requires_grad
                and before is not param
                and held[id(before)] > 0
            ):
                problems.append(
                    f"{path} is missing from the optimizer, which holds the Parameter that "
                    "was there before (a stale object: it was replaced after the optimizer "
                    "was built)"
                )
        if problems:
            broken.append(BrokenGroup("tied parameter", group, "; ".join(dict.fromkeys(problems))))
    return broken


def _validate_on_failure(on_failure: str) -> None:
    if on_failure not in ("raise", "warn"):
        raise ValueError(f"on_failure={on_failure!r}: use 'raise' or 'warn'.")


class TieCheck:
    """Record alias and tie groups now; ``verify`` them later.

    Args:
        module: the model, before ``fabric.setup`` (or any wrapping or compiling).
        on_failure: ``"raise"`` a ``TiedWeightsError`` naming each broken group
            (default), or ``"warn"``.
    """

    def __init__(
        self, module: torch.nn.Module, on_failure: Literal["raise", "warn"] = "raise"
    ) -> None:
        _validate_on_failure(on_failure)
        self.on_failure = on_failure
        self.recorded: ModuleGraph = snapshot(fabric_original_module(module))
        self.broken: list[BrokenGroup] | None = None

    def verify(self, module: torch.nn.Module, *optimizers: Any) -> list[BrokenGroup]:
        """Compare the record with the live module and optimizers; raise or warn."""
        optimizer_params = [
            p
            for opt in optimizers
            for group in getattr(opt, "optimizer", opt).param_groups
            for p in group["params"]
        ]
        live = snapshot(fabric_original_module(module))
        self.broken = check_ties(self.recorded, live, optimizer_params)
        aliases = len(self.recorded.own_alias_groups())
        ties = len(self.recorded.own_tie_groups())
        if not self.broken:
            rank_zero_info(
                f"tie check passed: {aliases} alias group(s), {ties} tie group(s) intact"
            )
            return self.broken
        message = f"{len(self.broken)} of {aliases + ties} alias/tie group(s) broke:\n" + "\n".join(
            f"  - {group}" for group in self.broken
        )
        if self.on_failure == "raise":
            raise TiedWeightsError(message)
        warnings.warn(message, stacklevel=2)
        return self.broken


class TiedWeightsCheck(Callback):
    """Fail loudly when aliases or tied weights did not survive to the first step.

    Args:
        on_failure: ``"raise"`` a ``TiedWeightsError`` (default) or ``"warn"``.
    """

    def __init__(self, on_failure: Literal["raise", "warn"] = "raise") -> None:
        _validate_on_failure(on_failure)
        self.on_failure = on_failure
        self.core: TieCheck | None = None
        self._stepped = False

    @property
    def recorded(self) -> ModuleGraph | None:
        return None if self.core is None else self.core.recorded

    @property
    def broken(self) -> list[BrokenGroup] | None:
        return None if self.core is None else self.core.broken

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.core = TieCheck(pl_module, self.on_failure)
            self._stepped = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any):
        if self._stepped and self.broken is None and self.core is not None:
            self.verify(trainer, pl_module)

    def verify(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[BrokenGroup]:
        """Compare the snapshot with the live module and optimizers; raise or warn."""
        assert self.core is not None, "verify() runs after setup()"
        return self.core.verify(pl_module, *trainer.optimizers)
