"""Knowing which region compiled what, and which region really ran compiled code.

Every region is compiled with a ``TrackingBackend``: it hands each graph to the real
backend (inductor, eager, a callable...) and wraps the compiled function so that each
call is counted against the region whose parameters it received.

One ``TrackingBackend`` exists per distinct real backend in the process. Dynamo keys
its cache entries on the backend, so a new backend object per ``compile_regions`` call
would recompile every block class again and, after a few calls, hit
``torch._dynamo.config.recompile_limit`` and fall back to eager. Sharing the backend
keeps one graph for identical blocks across calls; the tensor registry below tells
the calls of different models apart.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .regions import RegionPlan
from .watch import RecompileWatch

CompiledFn = Callable[..., Any]
COMPILE_ERROR_POLICIES = ("raise", "eager")


class RegionCompileError(RuntimeError):
    """The backend failed on one region's graph; the region is named, the cause chained."""


class RegionCompileWarning(UserWarning):
    """A region failed to compile and runs eager (``on_compile_error="eager"``)."""


@dataclass(eq=False)
class RegionStats:
    """What one region did: graphs compiled for it, compiled calls it ran, seconds."""

    label: str = ""
    on_compile_error: str = "raise"
    graphs: int = 0
    compiled_calls: int = 0
    compile_seconds: float = 0.0
    compile_error: str | None = None


class TensorOwners:
    """Which regions (their ``RegionStats``) own which parameters and buffers.

    Held by weak reference, so a region's tensors being freed drops its entries.
    """

    def __init__(self) -> None:
        self._owners: dict[int, list[tuple[weakref.ref[torch.Tensor], RegionStats]]] = {}

    def register(self, plan: RegionPlan, on_compile_error: str) -> list[RegionStats]:
        """Fresh stats for each region of ``plan``, owning the region's tensors."""
        self._drop_dead()
        all_stats = []
        for region in plan.regions:
            stats = RegionStats(label=region.label, on_compile_error=on_compile_error)
            tensors = {id(t): t for t in (*region.module.parameters(), *region.module.buffers())}
            for tensor_id, tensor in tensors.items():
                self._owners.setdefault(tensor_id, []).append((weakref.ref(tensor), stats))
            all_stats.append(stats)
        return all_stats

    def knows(self, tensor: object) -> bool:
        return bool(self._live(tensor))

    def most_owned(self, tensors: Sequence[object]) -> list[RegionStats]:
        """The regions owning the most of ``tensors`` (every one of them on a tie)."""
        hits: dict[RegionStats, int] = {}
        for tensor in tensors:
            for stats in self._live(tensor):
                hits[stats] = hits.get(stats, 0) + 1
        if not hits:
            return []
        best = max(hits.values())
        return [stats for stats, count in hits.items() if count == best]

    def _live(self, tensor: object) -> list[RegionStats]:
        entries = self._owners.get(id(tensor), ())
        return [stats for ref, stats in entries if ref() is tensor]

    def _drop_dead(self) -> None:
        for tensor_id in list(self._owners):
            alive = [(ref, s) for ref, s in self._owners[tensor_id] if ref() is not None]
            if alive:
                self._owners[tensor_id] = alive
            else:
                del self._owners[tensor_id]


OWNERS = TensorOwners()


class TrackingBackend:
    """A ``torch.compile`` backend that counts graphs and compiled calls per region."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.unattributed_graphs = 0
        self.__name__ = str(getattr(inner, "compiler_name", "regional"))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledFn:
        tensors = [*example_inputs, *gm.parameters(), *gm.buffers()]
        owners = OWNERS.most_owned(tensors)
        start = time.perf_counter()
        try:
            compiled = self.inner(gm, example_inputs)
        except Exception as error:
            return _handle_compile_error(error, gm, owners)
        seconds = time.perf_counter() - start
        if not owners:
            self.unattributed_graphs += 1
        for stats in owners:
            stats.graphs += 1
            stats.compile_seconds += seconds
        return _counting(compiled, [i for i, t in enumerate(example_inputs) if OWNERS.knows(t)])

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()


def _handle_compile_error(
    error: Exception, gm: torch.fx.GraphModule, owners: list[RegionStats]
) -> CompiledFn:
    """Raise naming the region, or let that region alone run its graph eagerly."""
    if not owners:
        raise error
    names = "; ".join(stats.label for stats in owners)
    cause = f"{type(error).__name__}: {error}"
    if any(stats.on_compile_error == "raise" for stats in owners):
        raise RegionCompileError(
            f"Compiling region {names} failed: {cause}. Pass on_compile_error='eager' to run "
            "this region eager and keep training."
        ) from error
    for stats in owners:
        stats.compile_error = cause
    warnings.warn(
        f"Region {names} failed to compile and runs eager: {cause}",
        RegionCompileWarning,
        stacklevel=2,
    )
    return gm.forward


def _counting(compiled: CompiledFn, positions: list[int]) -> CompiledFn:
    """Wrap ``compiled`` so each call counts for the region whose tensors it got."""

    def count(args: Sequence[Any]) -> None:
        for stats in OWNERS.most_owned([args[i] for i in positions if i < len(args)]):
            stats.compiled_calls += 1

    # Dynamo calls a backend's result with positional arguments, boxed or not.
    def run(*args: Any) -> Any:
        count(args)
        return compiled(*args)

    return run


_BACKENDS: list[TrackingBackend] = []


def tracking_backend(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
) -> TrackingBackend:
    """The process-wide tracking backend around what ``torch.compile`` would build."""
    if backend == "inductor":
        inner = torch._TorchCompileInductorWrapper(mode or "default", options, dynamic)
    else:
        inner = torch._TorchCompileWrapper(backend, mode or "default", options, dynamic)
    for existing in _BACKENDS:
        if existing.inner == inner:
            return existing
    _BACKENDS.append(TrackingBackend(inner))
    return _BACKENDS[-1]


@dataclass(eq=False)
class RegionTracker:
    """One ``compile_regions`` call: its plan, each region's stats, its recompiles."""

    plan: RegionPlan
    stats: list[RegionStats]
    backend: TrackingBackend
    watch: RecompileWatch

    @classmethod
    def start(
        cls, plan: RegionPlan, backend: TrackingBackend, on_compile_error: str = "raise"
    ) -> RegionTracker:
        stats = OWNERS.register(plan, on_compile_error)
        return cls(plan=plan, stats=stats, backend=backend, watch=RecompileWatch(plan))
