"""What the gate concludes, as frozen results computed from the timed steps: a phase's
medians (``phase_result``), whether its turns agree (``turns_agree``), the decision
(``PayoffDecision``) and what a run says that ended before one (``Undecided``) or that
follows an earlier fit's (``FollowedDecision``). Pure functions of ``TimedStep`` records:
nothing here reads a clock or a module.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.calls import COMPILED, EAGER
from .clock import COLLECTED_IN_STEP, COMPILED_IN_STEP, TimedStep

#: The range of ``k`` in a step's time growing as its batch's elements ``** k``.
SIZE_EXPONENT_RANGE = (0.0, 2.0)


@dataclass(frozen=True)
class SizeScaling:
    """How the timed steps' batches differed in size, and what their times were scaled
    to: ``reference`` elements, each step's time times ``(reference / its elements) **
    exponent``."""

    smallest: int
    largest: int
    reference: int
    exponent: float

    def __str__(self) -> str:
        return (
            f"batches of {self.smallest:,}-{self.largest:,} elements, each step scaled to "
            f"{self.reference:,} by size^{self.exponent:.2f}"
        )


def at_one_size(
    ms: list[float], elements: Sequence[int | None], ways: Sequence[object]
) -> tuple[list[float], SizeScaling | None]:
    """Step times ``ms`` of batches of ``elements`` (None: not seen), each of way
    ``ways[i]``, scaled to the median batch's elements by ``size ** k``, ``k`` the median
    slope of log time against log elements over pairs of steps of one way (Theil-Sen: one
    slow step moves it little), kept in ``SIZE_EXPONENT_RANGE``; as they are, with no
    scaling, where the sizes are all one or any is unknown."""
    known = [n for n in elements if n]
    if len(known) < len(elements) or len(set(known)) < 2:
        return ms, None
    slopes = [
        (math.log(ms[i]) - math.log(ms[j])) / (math.log(known[i]) - math.log(known[j]))
        for i, j in itertools.combinations(range(len(ms)), 2)
        if ways[i] == ways[j] and known[i] != known[j] and ms[i] > 0 and ms[j] > 0
    ]
    low, high = SIZE_EXPONENT_RANGE
    exponent = min(max(statistics.median(slopes), low), high) if slopes else 0.0
    reference = statistics.median_low(known)
    scaled = [t * (reference / n) ** exponent for t, n in zip(ms, known, strict=True)]
    return scaled, SizeScaling(min(known), max(known), reference, exponent)


def turns_agree(
    steps: Sequence[TimedStep], window_start: int, challenger_must_win: bool, edge: float
) -> bool:
    """Whether every pair of turns from ``window_start`` on (a challenger's step and the
    incumbent's after it, at one batch size, neither left out) falls on the same side of
    the decision: the way that must win by ``edge`` (the challenger where
    ``challenger_must_win``, a candidate against compiled; else the incumbent, compiled
    against eager) won by it in all, or in none."""
    scaled, _ = at_one_size([s.ms for s in steps], [s.elements for s in steps], _ways(steps))
    wins = []
    for i in range(window_start, len(steps) - 1, 2):
        if steps[i].left_out or steps[i + 1].left_out:
            continue
        challenger, incumbent = scaled[i], scaled[i + 1]
        ratio = challenger / incumbent if challenger_must_win else incumbent / challenger
        wins.append(ratio <= 1 - edge)
    return bool(wins) and len(set(wins)) == 1


def _ways(steps: Sequence[TimedStep]) -> list[str]:
    return [step.way for step in steps]


def not_counted(compiled: int, collected: int = 0) -> str:
    """What to say of timed steps left out of the medians: ``compiled`` for compiling,
    ``collected`` (of the others) for a full garbage collection."""
    parts = [f"{compiled} timed {_steps(compiled)} that compiled"] if compiled else []
    if collected:
        timed = "" if compiled else "timed "
        parts.append(f"{collected} {timed}{_steps(collected)} with a full garbage collection")
    return " and ".join(parts) + " not counted"


def timed_again(windows: int, window: int) -> str:
    """What to say of a phase timed over ``windows`` windows of ``window`` steps a way."""
    return f"{window * windows} steps a way: turns that disagreed were timed again"


def _steps(count: int) -> str:
    return "step" if count == 1 else "steps"


@dataclass(frozen=True)
class PhaseResult:
    """A phase's medians, in milliseconds, and how they were taken: the steps left out
    (``uncounted`` compiled, ``collected`` ran a full garbage collection and did not
    compile), the scaling to one batch size, and the windows timed."""

    incumbent_ms: float
    challenger_ms: float
    scaling: SizeScaling | None = None
    uncounted: int = 0
    collected: int = 0
    windows: int = 1

    def notes(self) -> list[str]:
        """What to say of the steps left out (scaling and windows are said apart)."""
        left_out = self.uncounted or self.collected
        return [not_counted(self.uncounted, self.collected)] if left_out else []


def phase_result(
    steps: Sequence[TimedStep], incumbent: str, challenger: str, windows: int = 1
) -> PhaseResult:
    """The incumbent's and the challenger's median step of ``steps``, leaving out the
    steps left out (where each way keeps one; else all count), at one batch size where
    their batches' elements differed (``at_one_size``)."""
    counted = [step for step in steps if not step.left_out]
    if {step.way for step in counted} != {incumbent, challenger}:  # a way would have none
        counted = list(steps)
    left_out = [step for step in steps if step.left_out] if len(counted) < len(steps) else []
    uncounted = sum(step.left_out == COMPILED_IN_STEP for step in left_out)
    collected = sum(step.left_out == COLLECTED_IN_STEP for step in left_out)
    scaled, scaling = at_one_size(
        [s.ms for s in counted], [s.elements for s in counted], _ways(counted)
    )
    by_way = {
        way: [ms for ms, step in zip(scaled, counted, strict=True) if step.way == way]
        for way in (incumbent, challenger)
    }
    return PhaseResult(
        statistics.median(by_way[incumbent]),
        statistics.median(by_way[challenger]),
        scaling,
        uncounted,
        collected,
        windows,
    )


@dataclass(frozen=True)
class Figure:
    """A candidate's median step (None if it did not run its window) and what to say
    of it (its memory, or why it does not count)."""

    way: str
    ms: float | None
    note: str = ""
    counts: bool = True

    def __str__(self) -> str:
        timed = f"{self.ms:.1f} ms" if self.ms is not None else "not timed"
        return f"{self.way} {timed}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class PayoffDecision:
    """What every process decided, and the medians this process measured: ``chosen``
    is ``"compiled"``, ``"eager"`` or a candidate's name; ``against_eager``: the phase
    that timed compiled against eager; ``candidates``: each candidate's figure;
    ``window``: the steps a way in one window."""

    against_eager: PhaseResult
    chosen: str
    candidates: tuple[Figure, ...]
    window: int

    @property
    def compiled_ms(self) -> float:
        return self.against_eager.incumbent_ms

    @property
    def eager_ms(self) -> float:
        return self.against_eager.challenger_ms

    @property
    def scaling(self) -> SizeScaling | None:
        return self.against_eager.scaling

    @property
    def uncounted(self) -> int:
        return self.against_eager.uncounted

    @property
    def collected(self) -> int:
        return self.against_eager.collected

    @property
    def windows(self) -> int:
        return self.against_eager.windows

    @property
    def kept(self) -> bool:
        """Whether the regions stay compiled (one way or another)."""
        return self.chosen != EAGER

    def __str__(self) -> str:
        others = "".join(f", {figure}" for figure in self.candidates)
        if self.chosen == EAGER:
            what = "regions reverted to eager"
        elif self.chosen == COMPILED:
            what = "regions kept compiled"
        else:
            what = f"regions kept compiled, with {self.chosen}"
        first = self.against_eager
        how = [str(first.scaling)] if first.scaling is not None else []
        how += first.notes()
        how += [timed_again(first.windows, self.window)] if first.windows > 1 else []
        measured = f" ({'; '.join(how)})" if how else ""
        return (
            f"compiled {self.compiled_ms:.1f} ms{others} vs eager {self.eager_ms:.1f} ms a "
            f"step{measured}: {what}"
        )


@dataclass(frozen=True)
class Undecided:
    """A run that ended before the decision: ``steps`` of the gate's ``needed`` ran
    (counted from the first compiled one); the regions stay compiled."""

    steps: int
    needed: int

    def __str__(self) -> str:
        return (
            f"not decided: the run ended after {self.steps} of the {self.needed} steps the "
            "keep-or-revert gate times; the regions stay compiled, unmeasured against eager"
        )


@dataclass(frozen=True)
class FollowedDecision:
    """A ``validate``, ``test`` or ``predict`` that runs the regions as an earlier fit's
    decision (``earlier``) chose."""

    earlier: PayoffDecision

    def __str__(self) -> str:
        return f"as decided on an earlier fit here: {self.earlier}"


#: What the region report shows of the gate: its decision, or why there is none.
GateOutcome = PayoffDecision | Undecided | FollowedDecision
