"""The gate's clock: marks at step boundaries and at each step's training start, and one
record per timed step (``TimedStep``: its way, its time, its batch's elements, why it is
left out of the medians).

A step runs from its training's start (the first ``training_starts`` after its boundary;
without one, from the boundary) to the next boundary. On a CUDA device the marks are
CUDA events, read once when the records are taken (one ``synchronize``), so no timed step
gains a host-device sync.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from ..compat import frames_compiled

#: Why a timed step is left out of the medians: dynamo compiled in it (seconds of
#: compiling in a step of milliseconds), or Python collected its oldest generation in it
#: (a pause that grows with every object the process holds, whichever way ran).
COMPILED_IN_STEP = "compiled"
COLLECTED_IN_STEP = "collected"


@dataclass(frozen=True)
class TimedStep:
    """One timed step: the way it ran, its milliseconds, its batches' elements (None: not
    seen) and why it is left out of the medians (None: it counts)."""

    way: str
    ms: float
    elements: int | None = None
    left_out: str | None = None


def batch_signature(batch: Any) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A batch's tensors (as Lightning finds them in a collection: mappings, sequences,
    dataclasses): their elements in all, and their shapes."""
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, torch.Tensor, lambda tensor: shapes.append(tuple(tensor.shape)))
    return sum(math.prod(shape) for shape in shapes), tuple(shapes)


def full_collections() -> int:
    """Python's collections of its oldest generation in this process so far (automatic or
    ``gc.collect()``): each a pause that grows with every object the process holds."""
    return int(gc.get_stats()[-1]["collections"])


@dataclass
class _Counts:
    """What the clock reads beside each mark: dynamo's compiles and Python's full
    collections so far."""

    compiles: int
    collections: int


@dataclass
class _Step:
    """A step on the clock: its boundary's mark, its training's start (where one came),
    its end (the next boundary), the counts at each, and its batches."""

    way: str
    boundary: Any
    at_boundary: _Counts
    start: Any = None
    at_start: _Counts | None = None
    end: Any = None
    at_end: _Counts | None = None
    elements: int | None = None
    shapes: set[tuple[tuple[int, ...], ...]] = field(default_factory=set)

    def began(self) -> tuple[Any, _Counts]:
        """Where its time begins: its training's start, or its boundary."""
        if self.start is not None and self.at_start is not None:
            return self.start, self.at_start
        return self.boundary, self.at_boundary


class StepClock:
    """Step boundaries and training starts on the wall clock, or CUDA events on a CUDA
    device. ``compiles`` and ``collections`` are counts that grow: dynamo's compiled
    frames and Python's full collections (given, so a test can script them)."""

    def __init__(
        self,
        device: torch.device,
        compiles: Callable[[], int] = frames_compiled,
        collections: Callable[[], int] = full_collections,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.compiles = compiles
        self.collections = collections
        self.steps: list[_Step] = []  # the last one is open until the next mark

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _counts(self) -> _Counts:
        return _Counts(self.compiles(), self.collections())

    def mark(self, way: str = "") -> None:
        """A step boundary: the open step ends, and one of ``way`` begins (until the next
        mark; its training starts at ``training_starts``)."""
        now, counts = self._now(), self._counts()
        if self.steps:
            self.steps[-1].end, self.steps[-1].at_end = now, counts
        self.steps.append(_Step(way, now, counts))

    def training_starts(self, batch: Any = None) -> None:
        """The open step begins its training (on ``batch``, where given) now: what ran
        between the boundary and now (validation, a checkpoint, data) is not in its time.
        The first call after a boundary starts it; each call adds its batch (gradient
        accumulation calls it once per micro-batch)."""
        if not self.steps:
            return
        step = self.steps[-1]
        if batch is not None:  # read before the start: not in the step's time
            elements, shapes = batch_signature(batch)
            step.elements = (step.elements or 0) + elements
            step.shapes.add(shapes)
        if step.start is None:
            step.at_start = self._counts()
            step.start = self._now()

    @property
    def marks(self) -> int:
        """Step boundaries marked so far."""
        return len(self.steps)

    def _ended(self) -> list[_Step]:
        return [step for step in self.steps if step.end is not None]

    def shapes(self) -> set[tuple[tuple[int, ...], ...]]:
        """Every shape of batch the steps trained on."""
        return {shape for step in self.steps for shape in step.shapes}

    def spans(self) -> list[tuple[Any, Any]]:
        """Each ended step's span on the clock: its training's start (or its boundary)
        and the next boundary (``time.perf_counter`` values, or CUDA events)."""
        return [(step.began()[0], step.end) for step in self._ended()]

    def records(self) -> list[TimedStep]:
        """One record for each ended step (on CUDA, after one ``synchronize``)."""
        ended = self._ended()
        if not ended:
            return []
        if self.cuda:
            ended[-1].end.synchronize()
        records = []
        for step in ended:
            start, at_start = step.began()
            assert step.at_end is not None
            if self.cuda:
                ms = start.elapsed_time(step.end)
            else:
                ms = 1000 * (step.end - start)
            left_out = None
            if step.at_end.compiles > at_start.compiles:
                left_out = COMPILED_IN_STEP
            elif step.at_end.collections > at_start.collections:
                left_out = COLLECTED_IN_STEP
            records.append(TimedStep(step.way, ms, step.elements, left_out))
        return records
