"""Compilation that pays, or steps aside: once the regions run compiled, time this run's
own training steps compiled and then eager, keep the faster, and say both figures.

The windows, counted in optimizer steps after the first compiled one (the default mode's
first step, the background mode's first step after its switch):

- ``SETTLE`` compiled steps are not timed (a last recompile, the allocator settling);
- ``WINDOW`` compiled steps are timed;
- the regions then run eager (their compiled calls set aside in place:
  ``compile.set_regions_eager``); one step settles, ``WINDOW`` eager steps are timed;
- the decision, once per setup that trains: the regions stay compiled only when the median
  compiled step is at least ``EDGE`` (1%) shorter than the median eager step (eager gets
  that edge, as torch's old ``autotune`` backend gave it), and every process agrees (all
  must find compiled faster), so ranks never train different code. Then it never changes:
  noise cannot flip it back and forth.

The steps timed are real training steps: nothing is rolled back or repeated. A step is
the time between two optimizer-step boundaries (data, forward, backward and optimizer, as
the user's loop runs them). On CUDA the boundaries are CUDA events, read once at the
decision (one ``synchronize``), so no timed step gains a host-device sync.

What it costs: the eager window is ``WINDOW + 1`` steps run eager where compiled may be
faster, so a run of 1,000 steps whose compiled step is ``r`` times faster than eager
loses ``(WINDOW + 1) * (r - 1) / 1000`` of its time: at most 1% up to ``r = 3``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .compile import set_regions_eager, tracker_of

#: Compiled steps not timed after the first compiled one.
SETTLE = 2
#: Steps timed compiled, then eager.
WINDOW = 4
#: Compiled must be at least this much faster than eager to be kept.
EDGE = 0.01


class Processes(Protocol):
    """What the decision needs of the job's processes (a Lightning strategy has it)."""

    @property
    def root_device(self) -> torch.device: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


@dataclass(frozen=True)
class PayoffDecision:
    """The medians this process measured, and what every process decided."""

    compiled_ms: float
    eager_ms: float
    kept: bool

    def __str__(self) -> str:
        what = "regions kept compiled" if self.kept else "regions reverted to eager"
        return f"compiled {self.compiled_ms:.1f} ms vs eager {self.eager_ms:.1f} ms a step: {what}"


class StepClock:
    """Marks at step boundaries: the wall clock, or CUDA events on a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def milliseconds(self, first: int, last: int) -> list[float]:
        """The steps between marks ``first`` and ``last``, in milliseconds."""
        marks = self.marks[first : last + 1]
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        return [1000 * (b - a) for a, b in itertools.pairwise(marks)]


class CompilePayoff:
    """Times a module's compiled regions against eager over its own steps and keeps the
    faster (see the module docstring). ``at_step_boundary`` after every optimizer step
    from the first compiled one on; it returns the decision once, when made."""

    def __init__(self) -> None:
        self.clock: StepClock | None = None  # made at the first timed boundary
        self.boundaries = 0
        self.decision: PayoffDecision | None = None

    def at_step_boundary(self, module: Any, processes: Processes) -> PayoffDecision | None:
        tracker = tracker_of(module)
        if self.decision is not None or tracker is None:
            return None
        self.boundaries += 1  # the first is the end of the first compiled step
        if self.boundaries <= SETTLE:
            return None
        if self.clock is None:
            self.clock = StepClock(processes.root_device)
        self.clock.mark()
        eager_from = WINDOW + 1  # marks 0..WINDOW time compiled steps; then one settles
        if len(self.clock.marks) == eager_from:
            set_regions_eager(module, True)
        if len(self.clock.marks) < eager_from + WINDOW + 1:
            return None
        compiled = statistics.median(self.clock.milliseconds(0, WINDOW))
        eager = statistics.median(self.clock.milliseconds(eager_from, eager_from + WINDOW))
        kept = processes.reduce_boolean_decision(compiled <= (1 - EDGE) * eager, all=True)
        if kept:
            set_regions_eager(module, False)
        self.decision = PayoffDecision(compiled, eager, kept)
        tracker.payoff = str(self.decision)
        return self.decision
