"""Compilation that pays, or steps aside: once the regions run compiled, time this run's
own training steps compiled against eager, then against each candidate (CUDA graphs,
where they may pay), keep the fastest, and say every figure.

The phases, counted in optimizer steps from the first compiled one (the default mode's
first step, the background mode's first step after its switch):

- **compiled against eager**: ``SETTLE + 1`` compiled steps settle untimed (the first
  compiles; a last recompile, the allocator settling); then ``2 * WINDOW`` steps are timed,
  eager and compiled in turn, one step each (the regions' compiled calls set aside and
  put back in place: ``compile.use_region_calls``; nothing recompiles; in Fabric's loops,
  which have no teardown to end the timing, set aside for training calls alone, so a
  loop that stops mid-turn evaluates compiled);
- **each candidate against compiled** (``Candidate``): the regions compiled again its way,
  for training calls (validation and generation keep the first compiled calls);
  ``CANDIDATE_SETTLE`` steps run it untimed (its compile, CUDA graphs' warm-up and
  recording), then ``2 * WINDOW`` steps compiled and the candidate in turn.

Each phase times one window of ``2 * WINDOW`` steps, or more where its turns disagree:
where a pair of turns (a step of each way, one after the other) says one way won by
``EDGE`` and another pair says it did not (``Phase.agrees``), a load from elsewhere on
the machine may have landed on some turns, and 4 steps a way decide on the load: another
window is timed, up to ``MAX_WINDOWS``, and the medians take every window's steps
(``benchmarks/gate_noise.py``, this code on scripted steps with 4% noise: at compiled
0.7-1.34x eager's, wrong decisions fell from 0.9-13.1% to 0.2-4.2% where a load of 2-12
steps at 1-6x came in 30% of runs, from 0-9.1% to 0-2.4% where none came, for 0-9.1 more
steps on average, the most where the two are within 5%).
Agreed by every process (another window unless all saw the turns agree); on CUDA, each
window's end reads its events (one ``synchronize``).

Ways take turns step by step because this project's machine, like any shared one, runs at
two speeds for tens of seconds at a time (plain eager steps of the tiny GPT at width 16:
49-51 ms, then 68-75 ms, with nothing else running and no steal time): windows of one way
and then the other would compare two speeds of the machine, turns compare the ways.

The decision, once per ``fit`` (the same strategy's ``validate``, ``test`` and
``predict`` of the model follow it: ``Decided``), agreed by every process (each boolean
must hold on all of them, so ranks never train different code), and then never changed,
so noise cannot flip it back and forth:

1. a candidate replaces the compiled calls only when its median step is at least ``EDGE``
   (1%) shorter than theirs and it ran as it claims (CUDA graphs that inductor skipped,
   its ``cudagraph_skips`` counter, do not count as CUDA graphs);
2. the regions stay compiled (that way) only when its median step is at least ``EDGE``
   shorter than the median eager step: eager gets that edge, as torch's old ``autotune``
   backend gave it.

The steps timed are real training steps: nothing is rolled back or repeated. A step's
time runs from its training's start (the Trainer's first ``training_step`` after the last
optimizer step; in Fabric's loops, the module's first forward with grad after it, unless
the module is itself the one region: then from the last optimizer step) to its optimizer
step's end: forward, backward and optimizer, as the user's loop runs them. What runs
between an optimizer step and the next training forward (validation, a checkpoint, data
loading) is not in it: validation every ``N`` steps, ``N`` even, would land on one way's
turns alone and decide for the other. On CUDA the marks are CUDA events, read once at the
end of each phase (one ``synchronize``), so no timed step gains a host-device sync.

Batches of varying size (variable-length text, an epoch's smaller last batch) would
decide on the batches, not the ways: 4 steps each way, of lengths drawn at random, differ
by more than compiled and eager do. So each timed step records its batches' elements (the
tensors Lightning would move to the device, ``apply_to_collection``; summed over a step's
micro-batches), and where they differ, every step's time is scaled to the median batch's
elements by ``size ** k`` before the medians (``at_one_size``): ``k`` is the median slope
of log time against log elements over pairs of steps of one way (Theil-Sen: one recompile
or a slow step moves it little), kept in ``[0, 2]`` (0 where a step's time does not grow
with its batch, a launch-bound one; 1 where it grows as the batch, 2 for attention's
square). Under several processes a step's size is the largest any of them had (a
synchronous step waits for the slowest; ``agreed_over_processes``, one all-reduce at the
decision). Where every batch has one size nothing is scaled. A candidate that needs static
shapes (CUDA graphs record one graph per shape) is not tried where the batches' shapes
varied in the turns against eager.

A timed step in which dynamo compiled (a recompile for a new shape, an epoch's smaller
last batch; ``StepClock.compiled_steps``, from its training's start to its end, agreed
over the processes: the others waited for it) holds seconds of compiling in a step of
milliseconds; one in which Python collected its oldest generation (``full_collections``:
automatic or a ``gc.collect()``; ``StepClock.collected_steps``) holds a pause that grows
with every object the process holds, not with the way (in this project's test processes,
after many compiles, 238-505 ms against steps of 2-150 ms). Either is left out of the
medians, and the log line says how many were, unless that would leave a way with no step
(then all count).

What it costs: ``WINDOW`` steps run eager where compiled may be faster, so a run of 1,000
steps whose compiled step is ``r`` times faster than eager loses ``WINDOW * (r - 1) /
1000`` of its time: at most 1% up to ``r = 3.5``, where the turns agree (a clear
difference does, unless a load lands on them); each window more adds ``WINDOW`` eager
steps, timed where the ways are close, so ``r`` is near 1 and they cost little. A
candidate adds its own compile (with CUDA graphs, the same kernels: inductor's caches
hold them) and ``CANDIDATE_SETTLE + 2 * WINDOW`` steps (a window or more), each at the
compiled step's pace or better.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from ..compat import cudagraph_skips, frames_compiled
from ..core.compile import COMPILED, EAGER, add_region_calls, tracker_of, use_region_calls
from ..options import RegionalOptions

#: Compiled steps not timed after the first compiled one.
SETTLE = 2
#: Steps a candidate runs untimed: its compile and warm-up, CUDA graphs' recording.
CANDIDATE_SETTLE = 3
#: Steps timed each way in a window.
WINDOW = 4
#: Windows a phase may time where the turns of the last one disagreed (``Phase.agrees``).
MAX_WINDOWS = 3
#: A way must be at least this much faster than the one it replaces to replace it.
EDGE = 0.01
#: The candidate that runs the regions' training calls as CUDA graphs.
CUDA_GRAPHS = "CUDA graphs"
#: ``torch.compile`` modes whose kernels are the default mode's, without CUDA graphs.
MODES_WITHOUT_CUDA_GRAPHS = (None, "default", "max-autotune-no-cudagraphs")
#: The range of ``k`` in a step's time growing as its batch's elements ``** k``.
SIZE_EXPONENT_RANGE = (0.0, 2.0)


class Processes(Protocol):
    """What the decision needs of the job's processes (a Lightning strategy has it)."""

    @property
    def root_device(self) -> torch.device: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


@dataclass(frozen=True)
class Candidate:
    """Another way to compile the regions' training calls, timed in the decision:
    ``compile_kwargs`` go to ``torch.compile``; ``cuda_graphs``: it claims CUDA graphs,
    and counts only where inductor skipped none."""

    name: str
    compile_kwargs: dict[str, Any]
    cuda_graphs: bool = False


def cuda_graphs_candidate(
    options: RegionalOptions, device: torch.device, single_process: bool, plain_steps: bool
) -> Candidate | None:
    """CUDA graphs (``mode="reduce-overhead"``) as a candidate where they may pay and are
    known to be safe: on CUDA, inductor in a mode without them and no inductor options of
    the user's, regions compiled whole with their hooks (not nested, not DeepSpeed's),
    one process (``single_process``), and one forward and backward per optimizer step
    (``plain_steps``: no gradient accumulation, whose second backward would overwrite
    the first's CUDA-graph outputs). Else None."""
    if device.type != "cuda" or options.backend != "inductor":
        return None
    if options.mode not in MODES_WITHOUT_CUDA_GRAPHS or options.options is not None:
        return None
    if options.granularity != "regions" or not (single_process and plain_steps):
        return None
    kwargs = {**options.compile_kwargs, "mode": "reduce-overhead"}
    return Candidate(CUDA_GRAPHS, kwargs, cuda_graphs=True)


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


def batch_signature(batch: Any) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """A batch's tensors (as Lightning finds them in a collection: mappings, sequences,
    dataclasses): their elements in all, and their shapes."""
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, torch.Tensor, lambda tensor: shapes.append(tuple(tensor.shape)))
    return sum(math.prod(shape) for shape in shapes), tuple(shapes)


def at_one_size(
    ms: list[float], elements: list[int | None], ways: list[int]
) -> tuple[list[float], SizeScaling | None]:
    """Step times ``ms`` of batches of ``elements`` (None: not seen), each of way
    ``ways[i]``, scaled to the median batch's elements (see the module docstring); as
    they are, with no scaling, where the sizes are all one or any is unknown."""
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


def timed_again(windows: int) -> str:
    """What to say of a phase timed over ``windows`` windows."""
    return f"{WINDOW * windows} steps a way: turns that disagreed were timed again"


def not_counted(compiled: int, collected: int = 0) -> str:
    """What to say of timed steps left out of the medians: ``compiled`` for compiling,
    ``collected`` (of the others) for a full garbage collection."""
    parts = [f"{compiled} timed {_steps(compiled)} that compiled"] if compiled else []
    if collected:
        timed = "" if compiled else "timed "
        parts.append(f"{collected} {timed}{_steps(collected)} with a full garbage collection")
    return " and ".join(parts) + " not counted"


def _steps(count: int) -> str:
    return "step" if count == 1 else "steps"


def full_collections() -> int:
    """Python's collections of its oldest generation in this process so far (automatic or
    ``gc.collect()``): each a pause that grows with every object the process holds."""
    return int(gc.get_stats()[-1]["collections"])


@dataclass(frozen=True)
class PayoffDecision:
    """The medians this process measured, and what every process decided: ``chosen``
    is ``"compiled"``, ``"eager"`` or a candidate's name; ``scaling``: how the steps'
    times were scaled to one batch size, where the batches differed; ``uncounted``: timed
    steps left out of the medians because dynamo compiled in them, ``collected``: because
    Python ran a full garbage collection in them (and none compiled); ``windows``: the
    windows compiled and eager were timed over (more than one where turns disagreed)."""

    compiled_ms: float
    eager_ms: float
    chosen: str
    candidates: tuple[Figure, ...] = ()
    scaling: SizeScaling | None = None
    uncounted: int = 0
    windows: int = 1
    collected: int = 0

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
        how = [str(self.scaling)] if self.scaling is not None else []
        left_out = self.uncounted or self.collected
        how += [not_counted(self.uncounted, self.collected)] if left_out else []
        how += [timed_again(self.windows)] if self.windows > 1 else []
        measured = f" ({'; '.join(how)})" if how else ""
        return (
            f"compiled {self.compiled_ms:.1f} ms{others} vs eager {self.eager_ms:.1f} ms a "
            f"step{measured}: {what}"
        )


class StepClock:
    """Marks at step boundaries, where a step's training began after its boundary (the
    wall clock, or CUDA events on a CUDA device), the batches it trained on, and whether
    dynamo compiled anything while it trained (``compiles``: a count that grows) or Python
    collected its oldest generation (``collections``: a count that grows)."""

    def __init__(
        self,
        device: torch.device,
        compiles: Callable[[], int] = frames_compiled,
        collections: Callable[[], int] = full_collections,
    ) -> None:
        self.cuda = device.type == "cuda"
        self.compiles = compiles
        self.collections = collections
        self.marks: list[Any] = []
        self.compiles_at_marks: list[int] = []
        self.collections_at_marks: list[int] = []
        self.starts: dict[int, Any] = {}  # the step after mark i began training here
        self.compiles_at_starts: dict[int, int] = {}  # ... with this many compiles so far
        self.collections_at_starts: dict[int, int] = {}  # ... and full collections
        self.elements: dict[int, int] = {}  # ... on batches of this many elements in all
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()  # every batch's shapes

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        """A step boundary: one step ends, the next begins (until ``training_starts``)."""
        self.marks.append(self._now())
        self.compiles_at_marks.append(self.compiles())
        self.collections_at_marks.append(self.collections())

    def training_starts(self, batch: Any = None) -> None:
        """The step after the last boundary begins its training (on ``batch``, where
        given) now: what ran between the boundary and now (validation, a checkpoint,
        data) is not in its time. The first call after a boundary starts it; each call
        adds its batch (gradient accumulation calls it once per micro-batch)."""
        if self.marks:
            step = len(self.marks) - 1
            if batch is not None:  # read before the start: not in the step's time
                elements, shapes = batch_signature(batch)
                self.elements[step] = self.elements.get(step, 0) + elements
                self.shapes.add(shapes)
            if step not in self.starts:
                self.compiles_at_starts[step] = self.compiles()
                self.collections_at_starts[step] = self.collections()
                self.starts[step] = self._now()

    def batch_elements(self) -> list[int | None]:
        """Each step's batches' elements (None where no batch was given)."""
        return [self.elements.get(i) for i in range(len(self.marks) - 1)]

    def compiled_steps(self) -> list[bool]:
        """Whether dynamo compiled anything in each step, from its training's start (or
        its boundary) to the next boundary: a first compile or a recompile (a new shape),
        seconds where the step's own work is milliseconds."""
        return _grew_in_steps(self.compiles_at_marks, self.compiles_at_starts)

    def collected_steps(self) -> list[bool]:
        """Whether Python collected its oldest generation in each step, from its
        training's start (or its boundary) to the next boundary: a pause that grows with
        the objects the process holds, whichever way the step ran."""
        return _grew_in_steps(self.collections_at_marks, self.collections_at_starts)

    def spans(self) -> list[tuple[Any, Any]]:
        """Each step's span on the clock: its training's start (or its boundary) and the
        next boundary (``time.perf_counter`` values, or CUDA events)."""
        bounds = itertools.pairwise(self.marks)
        return [(self.starts.get(i, a), b) for i, (a, b) in enumerate(bounds)]

    def milliseconds(self) -> list[float]:
        """Each step's time, from its training's start (or its boundary) to the next
        boundary, in milliseconds."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in self.spans()]
        return [1000 * (b - a) for a, b in self.spans()]


def _grew_in_steps(at_marks: list[int], at_starts: dict[int, int]) -> list[bool]:
    """Whether a count read at each step boundary (``at_marks``) and at each step's
    training start (``at_starts``, where one was marked) grew within each step."""
    return [at_marks[i + 1] > at_starts.get(i, at_marks[i]) for i in range(len(at_marks) - 1)]


@dataclass(frozen=True)
class TimedSteps:
    """A phase's timed steps, as every process saw them: each step's batch elements
    (None: not known), whether dynamo compiled in it and whether Python ran a full garbage
    collection in it (``collected``; none where not given)."""

    elements: list[int | None]
    compiled: list[bool]
    collected: list[bool] = field(default_factory=list)

    def left_out(self) -> list[bool]:
        """Whether each step is left out of the medians: it compiled or collected."""
        collected = self.collected or [False] * len(self.compiled)
        return [a or b for a, b in zip(self.compiled, collected, strict=True)]


@dataclass
class Phase:
    """Steps that time ``challenger`` against ``incumbent``: ``settle`` untimed steps (of
    the way already in place), then ``2 * WINDOW`` steps, the challenger and the
    incumbent in turn."""

    incumbent: str
    challenger: str
    settle: int
    candidate: Candidate | None = None
    clock: StepClock | None = None  # made at its first mark, on the job's device
    steps: int = 0
    skips_before: int = 0
    reserved_before: int = 0
    counts: bool = True  # False where the challenger did not run as it claims
    notes: list[str] = field(default_factory=list)
    skipped: bool = False  # not run: its candidate needs static shapes, and they varied
    windows: int = 1  # windows of 2 * WINDOW steps begun (more where turns disagreed)
    finished: bool = False  # its last window timed
    scaling: SizeScaling | None = None  # set by ``medians``
    uncounted: int = 0  # timed steps that compiled, left out by ``medians``
    collected: int = 0  # ... that ran a full garbage collection (and did not compile)

    @property
    def marks(self) -> int:
        return 0 if self.clock is None else len(self.clock.marks)

    @property
    def done(self) -> bool:
        return self.skipped or self.finished

    @property
    def at_window_end(self) -> bool:
        return self.marks == 2 * WINDOW * self.windows + 1

    def agrees(self) -> bool:
        """Whether every pair of turns in its last window (a challenger's step and the
        incumbent's after it, at one batch size, neither left out) falls on the same
        side of the decision: the way that must win by ``EDGE`` (compiled against eager;
        a candidate against compiled) won by it in all, or in none. A load from
        elsewhere that lands on some turns makes them disagree; then another window is
        timed (``MAX_WINDOWS`` at most) and the medians take every window's steps."""
        assert self.clock is not None
        timed = self.timed_steps()
        left_out = timed.left_out()
        ways = [i % 2 for i in range(len(left_out))]
        scaled, _ = at_one_size(self.clock.milliseconds(), timed.elements, ways)
        first = 2 * WINDOW * (self.windows - 1)
        wins = [
            self._must_win(scaled[i], scaled[i + 1]) <= 1 - EDGE
            for i in range(first, len(scaled) - 1, 2)
            if not (left_out[i] or left_out[i + 1])
        ]
        return bool(wins) and len(set(wins)) == 1

    def _must_win(self, challenger_ms: float, incumbent_ms: float) -> float:
        """The ratio of the way that must win by ``EDGE`` to the other's: a candidate
        (the challenger) against compiled; compiled (the incumbent) against eager."""
        if self.candidate is not None:
            return challenger_ms / incumbent_ms
        return incumbent_ms / challenger_ms

    def next_way(self) -> str:
        """The way of the step that starts now (after the last mark)."""
        timed = self.marks - 1  # steps timed so far
        return self.challenger if timed % 2 == 0 else self.incumbent

    def timed_steps(self) -> TimedSteps:
        """Its timed steps on this process (none where it did not run)."""
        if self.clock is None:
            return TimedSteps([], [])
        clock = self.clock
        return TimedSteps(clock.batch_elements(), clock.compiled_steps(), clock.collected_steps())

    def medians(self, timed: TimedSteps) -> tuple[float, float]:
        """The incumbent's and the challenger's median step, in milliseconds, leaving out
        the steps that ``timed`` says compiled or collected garbage (where each way keeps
        one), at one batch size where the steps' batch elements differed
        (``at_one_size``)."""
        assert self.clock is not None
        steps = self.clock.milliseconds()
        ways = [i % 2 for i in range(len(steps))]  # 0: the challenger's turn
        counted = [i for i, out in enumerate(timed.left_out()) if not out]
        if {ways[i] for i in counted} != {0, 1}:  # a way would have none: count them all
            counted = list(range(len(steps)))
        left_out = sorted(set(range(len(steps))) - set(counted))
        self.uncounted = sum(timed.compiled[i] for i in left_out)
        self.collected = len(left_out) - self.uncounted
        if left_out:
            self.notes.append(not_counted(self.uncounted, self.collected))
        ways = [ways[i] for i in counted]
        elements = [timed.elements[i] for i in counted]
        scaled, self.scaling = at_one_size([steps[i] for i in counted], elements, ways)
        by_way = [[ms for ms, way in zip(scaled, ways, strict=True) if way == w] for w in (1, 0)]
        return statistics.median(by_way[0]), statistics.median(by_way[1])


def passes_through(module: Any, args: Any, kwargs: Any) -> None:
    """A forward pre-hook (``with_kwargs=True``) that changes nothing: what a
    ``TrainingForwardHook`` becomes in a copy of its module."""


class TrainingForwardHook:
    """A forward pre-hook (``with_kwargs=True``: ``model(**batch)`` has its batch in its
    keyword arguments) that starts ``payoff``'s timed step at a forward with grad (a
    Fabric loop's training forward; a ``no_grad`` validation starts nothing). Pickled
    and copied as ``functools.partial(passes_through)``: a copy of the module made while
    the gate times holds none of the gate's state, as the tracker's ``__reduce__``
    makes it."""

    def __init__(self, payoff: CompilePayoff) -> None:
        self.payoff = payoff

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():
            self.payoff.training_starts((args, kwargs))

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (passes_through,))


class CompilePayoff:
    """Times a module's compiled regions against eager (and ``candidates``) over its own
    steps and keeps the fastest (see the module docstring). ``at_step_boundary`` after
    every optimizer step from the first compiled one on; it returns the decision once,
    when made."""

    def __init__(self, candidates: tuple[Candidate, ...] = (), eager_turn: str = EAGER) -> None:
        """``eager_turn``: what an eager turn runs, ``compile.EAGER`` (every call eager:
        the Trainer's, whose teardown ends the timing) or ``compile.EAGER_WHILE_TRAINING``
        (Fabric's: calls outside training stay compiled, as after a loop that stopped
        mid-turn; a ``no_grad`` call inside a training step stays compiled in the turn)."""
        self.candidates = candidates
        self.eager_turn = eager_turn
        self.phases: list[Phase] = []  # made at the first boundary, on the device
        self.decision: PayoffDecision | None = None
        self.cuda_graphs = False  # whether the regions' training calls may be CUDA graphs
        self._modules: list[Any] = []  # the modules timed, once timing began

    def end(self) -> str | None:
        """The run ends: where it ended before the decision (mid-turn), the regions run
        compiled again, not the way that turn left them, and the region report says how
        far the gate got (``undecided``, returned; None where decided or never begun)."""
        if self.decision is not None or not self.phases:
            return None
        self._use(COMPILED)
        self.cuda_graphs = False
        said = self.undecided()
        for module in self._modules:
            tracker = tracker_of(module)
            if tracker is not None:
                tracker.payoff = said
        return said

    def undecided(self) -> str:
        """What a run that ended before the decision says: how many of the gate's steps
        it ran (counted from the first compiled one), and that the regions stay compiled,
        unmeasured against eager."""
        steps = sum(phase.steps for phase in self.phases)
        needed = sum(phase.settle + 2 * WINDOW * phase.windows for phase in self.phases)
        return (
            f"not decided: the run ended after {steps} of the {needed} steps the "
            "keep-or-revert gate times; the regions stay compiled, unmeasured against eager"
        )

    def rolled_back(self) -> None:
        """The steps timed so far were rolled back (a checkpoint restored mid-fit, as
        Lightning's batch-size and learning-rate searches do after their trial steps):
        the regions run compiled again, as before any timing; the steps that follow are
        timed by a new ``CompilePayoff``."""
        self._use(COMPILED)

    def _use(self, way: str) -> None:
        """Run every timed module's regions ``way`` (``compile.use_region_calls``)."""
        for module in self._modules:
            use_region_calls(module, way)

    def training_starts(self, batch: Any = None) -> None:
        """A training step begins its forward on ``batch`` (the Trainer's
        ``training_step``, a Fabric forward with grad): its timed step starts here, not
        at the last boundary."""
        if self.decision is None:
            phase = self._current_phase()
            if phase is not None and phase.clock is not None:
                phase.clock.training_starts(batch)

    def _current_phase(self) -> Phase | None:
        """The first phase not done (None before the first boundary or once all are)."""
        return next((phase for phase in self.phases if not phase.done), None)

    def at_step_boundary(
        self, modules: Sequence[Any], processes: Processes
    ) -> PayoffDecision | None:
        """A step of ``modules`` (each with regions compiled in place; one step switches
        them all to one way) ended."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs are done
        trackers = {id(module): tracker_of(module) for module in modules}
        if self.decision is not None or not any(trackers.values()):
            return None
        self._modules = [module for module in modules if trackers[id(module)] is not None]
        if not self.phases:
            self.phases = [
                Phase(COMPILED, EAGER, SETTLE + 1),
                *(Phase(COMPILED, c.name, CANDIDATE_SETTLE, c) for c in self.candidates),
            ]
        phase = self._current_phase()
        assert phase is not None  # undecided: a phase is still running
        phase.steps += 1
        if phase.steps < phase.settle:
            return None
        device = processes.root_device
        if phase.clock is None:
            phase.clock = StepClock(device)
        phase.clock.mark()
        if phase.at_window_end:
            # every process times the same windows: another unless all saw the turns agree
            agreed = processes.reduce_boolean_decision(phase.agrees(), all=True)
            if agreed or phase.windows == MAX_WINDOWS:
                phase.finished = True
            else:
                phase.windows += 1
        if not phase.done:
            way = phase.next_way()
            self._use(self.eager_turn if way == EAGER else way)
            return None
        self._end(phase, device)
        self._skip_static_shape_candidates()
        following = [later for later in self.phases if not later.done]
        if following:
            self._start(following[0], device)
            return None
        self.decision = self._decide(processes)
        self._use(self.decision.chosen)
        self.cuda_graphs = any(
            c.cuda_graphs and c.name == self.decision.chosen for c in self.candidates
        )
        for module in self._modules:
            trackers[id(module)].payoff = str(self.decision)  # type: ignore[union-attr]
        return self.decision

    def _skip_static_shape_candidates(self) -> None:
        """CUDA graphs record one graph per shape: not tried where the batches' shapes
        varied in the turns against eager."""
        first = self.phases[0]
        if first.clock is None or len(first.clock.shapes) < 2:
            return
        for phase in self.phases[1:]:
            if phase.candidate is not None and phase.candidate.cuda_graphs and not phase.done:
                phase.skipped = True
                phase.counts = False
                phase.notes.append("not tried: the batches' shapes vary")

    def _start(self, phase: Phase, device: torch.device) -> None:
        """Put ``phase``'s candidate in place for its settling steps."""
        candidate = phase.candidate
        assert candidate is not None  # only the first phase has none, and it is in place
        for module in self._modules:
            add_region_calls(module, candidate.name, candidate.compile_kwargs)
        phase.skips_before = cudagraph_skips()
        phase.reserved_before = _reserved(device)
        self.cuda_graphs = candidate.cuda_graphs
        self._use(candidate.name)

    def _end(self, phase: Phase, device: torch.device) -> None:
        """What ``phase`` showed besides its times: a candidate's memory, and skips."""
        candidate = phase.candidate
        if candidate is None:
            return
        if device.type == "cuda":
            grown = (_reserved(device) - phase.reserved_before) / 2**20
            phase.notes.append(f"{grown:+.0f} MiB reserved")
        skipped = cudagraph_skips() - phase.skips_before
        if candidate.cuda_graphs and skipped:
            phase.counts = False
            phase.notes.append(
                f"inductor skipped CUDA graphs for {skipped} graph(s), not counted: "
                "TORCH_LOGS=cudagraphs says why"
            )

    def _decide(self, processes: Processes) -> PayoffDecision:
        first, *tried = self.phases
        timed = agreed_over_processes([phase.timed_steps() for phase in self.phases], processes)
        compiled_ms, eager_ms = first.medians(timed[0])
        best_way, best_ms = COMPILED, compiled_ms
        figures = []
        for phase, phase_timed in zip(tried, timed[1:], strict=True):
            faster, scaled = False, best_ms
            if phase.skipped:
                figures.append(Figure(phase.challenger, None, "; ".join(phase.notes), False))
            else:
                against, ms = phase.medians(phase_timed)  # compiled again, in turns
                if phase.windows > 1:
                    phase.notes.append(timed_again(phase.windows))
                figures.append(Figure(phase.challenger, ms, "; ".join(phase.notes), phase.counts))
                scaled = ms * compiled_ms / against  # on the first phase's scale, beside eager's
                faster = phase.counts and scaled <= (1 - EDGE) * best_ms
            # every process calls each reduction, whatever it skipped, so none waits alone
            if processes.reduce_boolean_decision(faster, all=True):
                best_way, best_ms = phase.challenger, scaled
        kept = processes.reduce_boolean_decision(best_ms <= (1 - EDGE) * eager_ms, all=True)
        chosen = best_way if kept else EAGER
        return PayoffDecision(
            compiled_ms,
            eager_ms,
            chosen,
            tuple(figures),
            first.scaling,
            first.uncounted,
            first.windows,
            first.collected,
        )


class Decided:
    """Each module's last decision, kept for its ``validate``, ``test`` and ``predict``
    by the same strategy until a new fit of it begins timing (``forget``): held weakly,
    so a module gone takes its decision with it; pickled and copied empty
    (``torch.save(trainer)``, a spawned process), as a decision holds for the process
    that measured it."""

    def __init__(self) -> None:
        self._by_module: weakref.WeakKeyDictionary[Any, PayoffDecision] = (
            weakref.WeakKeyDictionary()
        )

    def record(self, modules: Sequence[Any], decision: PayoffDecision) -> None:
        self._by_module.update(dict.fromkeys(modules, decision))

    def get(self, module: Any) -> PayoffDecision | None:
        return self._by_module.get(module)

    def forget(self, modules: Sequence[Any]) -> None:
        """A new fit of ``modules`` measures its own steps: until it decides, what they
        follow is its state (compiled), not an earlier fit's decision."""
        for module in modules:
            self._by_module.pop(module, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Decided, ())


def agreed_over_processes(phases: list[TimedSteps], processes: Processes) -> list[TimedSteps]:
    """Each phase's timed steps (``Phase.timed_steps``) as the job ran them: a synchronous
    step (DDP's gradient all-reduce) takes about as long as its slowest rank's, so a
    step's batch elements are the largest over the processes (the rank with the most
    work), and a step compiled (or collected garbage) where any process did in it (the
    others waited). A
    phase where any process lacks a step's size comes back with sizes all None (compared
    unscaled). One all-reduce of every phase at once, which every process makes alike;
    as they are in one process."""
    world = getattr(processes, "world_size", 1)
    if world <= 1 or not torch.distributed.is_initialized():
        return phases
    width = 2 * WINDOW * MAX_WINDOWS  # room for a phase's every window
    payload: list[int] = []
    for timed in phases:  # each a phase's timed steps (as many on every process), or none
        known = bool(timed.elements) and all(timed.elements)
        sizes = [n or 0 for n in timed.elements]
        payload += sizes + [0] * (width - len(sizes)) + [-1 if known else 0]
        for flags in (timed.compiled, timed.collected):
            payload += [int(flag) for flag in flags] + [0] * (width - len(flags))
    tensor = torch.tensor(payload, dtype=torch.int64, device=processes.root_device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    values = tensor.tolist()
    agreed: list[TimedSteps] = []
    stride = 3 * width + 1
    for index, timed in enumerate(phases):
        chunk = values[index * stride : (index + 1) * stride]
        steps = len(timed.elements)
        largest: list[int | None] = list(chunk[:steps]) if chunk[width] == -1 else [None] * steps
        compiled, collected = (
            [bool(flag) for flag in chunk[start : start + steps]]
            for start in (width + 1, 2 * width + 1)
        )
        agreed.append(TimedSteps(largest, compiled, collected))
    return agreed


def _reserved(device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` (0 elsewhere)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
