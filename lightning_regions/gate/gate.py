"""Compilation that pays, or steps aside: once the regions run compiled, time this run's
own training steps compiled against eager, then against each candidate (CUDA graphs,
where they may pay), keep the fastest, and say every figure.

The phases, counted in optimizer steps from the first compiled one (the default mode's
first step, the background mode's first step after its switch):

- **compiled against eager**: ``SETTLE + 1`` compiled steps settle untimed (the first
  compiles; a last recompile, the allocator settling); then ``2 * WINDOW`` steps are timed,
  eager and compiled in turn, one step each (the regions' calls switched in place:
  ``core.compile.use_region_calls``; nothing recompiles; in Fabric's loops, which have no
  teardown to end the timing, switched for training calls alone, so a loop that stops
  mid-turn evaluates compiled);
- **each candidate against compiled** (``Candidate``): the regions compiled again its way,
  for training calls (validation and generation keep the first compiled calls);
  ``CANDIDATE_SETTLE`` steps run it untimed (its compile, CUDA graphs' warm-up and
  recording), then ``2 * WINDOW`` steps compiled and the candidate in turn.

Each phase times one window of ``2 * WINDOW`` steps, or more where its turns disagree
(``decision.turns_agree``): a load from elsewhere on the machine may have landed on some
turns, so another window is timed, up to ``MAX_WINDOWS``, and the medians take every
window's steps (``benchmarks/gate_noise.py`` measures what this buys, on scripted steps).
Every process times the same windows (another unless all saw the turns agree); on CUDA,
each window's end reads its events (one ``synchronize``). Ways take turns step by step
because a shared machine runs at two speeds for tens of seconds at a time: windows of one
way and then the other would compare two speeds of the machine, turns compare the ways.

The decision, once per ``fit`` (the same strategy's ``validate``, ``test`` and
``predict`` of the model follow it: ``Decided``), agreed by every process (each boolean
must hold on all of them, so ranks never train different code), and then never changed,
so noise cannot flip it back and forth:

1. a candidate replaces the compiled calls only when its median step is at least ``EDGE``
   shorter than theirs and it ran as it claims (CUDA graphs that inductor skipped,
   its ``cudagraph_skips`` counter, do not count as CUDA graphs);
2. the regions stay compiled (that way) only when its median step is at least ``EDGE``
   shorter than the median eager step: eager gets that edge, as torch's old ``autotune``
   backend gave it.

The steps timed are real training steps: nothing is rolled back or repeated. A step's
time runs from its training's start (the Trainer's first ``training_step`` after the last
optimizer step; in Fabric's loops, the module's first forward with grad after it, unless
the module is itself the one region: then from the last optimizer step) to its optimizer
step's end (``clock.StepClock``). What runs between an optimizer step and the next
training forward (validation, a checkpoint, data loading) is not in it: validation every
``N`` steps, ``N`` even, would land on one way's turns alone and decide for the other.

Batches of varying size would decide on the batches, not the ways, so each timed step
records its batches' elements and, where they differ, every step's time is scaled to the
median batch's (``decision.at_one_size``). Under several processes a step's size is the
largest any of them had (a synchronous step waits for the slowest;
``agreed_over_processes``, one all-reduce at the decision). A candidate that needs static
shapes (CUDA graphs record one graph per shape) is not tried where the batches' shapes
varied in the turns against eager. A timed step in which dynamo compiled, or Python
collected its oldest generation, is left out of the medians (agreed over the processes:
the others waited for it), and the log line says how many were, unless that would leave a
way with no step (then all count).

What it costs: ``WINDOW`` steps run eager where compiled may be faster, so a run of
``n`` steps whose compiled step is ``r`` times faster than eager loses ``WINDOW * (r - 1)
/ n`` of its time; each window more adds ``WINDOW`` eager steps, timed where the ways are
close. A candidate adds its own compile (with CUDA graphs, the same kernels: inductor's
caches hold them) and ``CANDIDATE_SETTLE + 2 * WINDOW`` steps, each at the compiled
step's pace or better.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..compat import cudagraph_skips
from ..core.calls import COMPILED, EAGER
from ..core.compile import add_region_calls, tracker_of, use_region_calls
from ..options import RegionalOptions
from .clock import COLLECTED_IN_STEP, COMPILED_IN_STEP, StepClock, TimedStep
from .decision import (
    Figure,
    FollowedDecision,
    GateOutcome,
    PayoffDecision,
    PhaseResult,
    Undecided,
    phase_result,
    timed_again,
    turns_agree,
)

#: Compiled steps not timed after the first compiled one.
SETTLE = 2
#: Steps a candidate runs untimed: its compile and warm-up, CUDA graphs' recording.
CANDIDATE_SETTLE = 3
#: Steps timed each way in a window.
WINDOW = 4
#: Windows a phase may time where the turns of the last one disagreed.
MAX_WINDOWS = 3
#: A way must be at least this much faster than the one it replaces to replace it.
EDGE = 0.01
#: The candidate that runs the regions' training calls as CUDA graphs.
CUDA_GRAPHS = "CUDA graphs"
#: ``torch.compile`` modes whose kernels are the default mode's, without CUDA graphs.
MODES_WITHOUT_CUDA_GRAPHS = (None, "default", "max-autotune-no-cudagraphs")


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


@dataclass
class Phase:
    """Steps that time ``challenger`` against ``incumbent``: ``settle`` untimed steps (of
    the way already in place), then windows of ``2 * WINDOW`` steps, the challenger and
    the incumbent in turn. Its results are computed from its clock's records
    (``records``, ``result``); what it holds is where it stands, and what a candidate
    showed besides its times (``counts``, ``notes``)."""

    incumbent: str
    challenger: str
    settle: int
    candidate: Candidate | None = None
    clock: StepClock | None = None  # made at its first mark, on the job's device
    steps: int = 0  # step boundaries seen, from the phase's start
    windows: int = 1  # windows of 2 * WINDOW steps begun (more where turns disagreed)
    finished: bool = False  # its last window timed
    skipped: bool = False  # not run: its candidate needs static shapes, and they varied
    counts: bool = True  # False where the challenger did not run as it claims
    notes: list[str] = field(default_factory=list)
    skips_before: int = 0  # inductor's CUDA-graph skips when the candidate began
    reserved_before: int = 0  # the CUDA allocator's bytes then

    @property
    def marks(self) -> int:
        return 0 if self.clock is None else self.clock.marks

    @property
    def done(self) -> bool:
        return self.skipped or self.finished

    @property
    def at_window_end(self) -> bool:
        return self.marks == 2 * WINDOW * self.windows + 1

    def way_of(self, index: int) -> str:
        """The way of timed step ``index`` (from 0): the challenger's turn first."""
        return self.challenger if index % 2 == 0 else self.incumbent

    def records(self) -> list[TimedStep]:
        """Its timed steps on this process (none where it did not run)."""
        return [] if self.clock is None else self.clock.records()

    def agrees(self, steps: Sequence[TimedStep] | None = None) -> bool:
        """Whether its last window's turns agree (``decision.turns_agree``): a candidate
        must win against compiled, compiled against eager."""
        steps = self.records() if steps is None else steps
        first = 2 * WINDOW * (self.windows - 1)
        return turns_agree(steps, first, self.candidate is not None, EDGE)

    def result(self, steps: Sequence[TimedStep]) -> PhaseResult:
        """Its medians over ``steps`` (its records, as the job agreed them)."""
        return phase_result(steps, self.incumbent, self.challenger, self.windows)


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


def show_in_report(modules: Sequence[Any], outcome: GateOutcome | None) -> None:
    """Let each module's region report show the gate's ``outcome`` (the object itself,
    read by ``diagnosis.report``; None: nothing to show)."""
    for module in modules:
        tracker = tracker_of(module)
        if tracker is not None:
            tracker.gate_outcome = outcome


def follow(module: Any, earlier: PayoffDecision) -> FollowedDecision:
    """Run ``module``'s regions as an earlier fit's decision chose (a ``validate``,
    ``test`` or ``predict``), and show it in its report; what to say of it."""
    if earlier.chosen == EAGER:
        use_region_calls(module, EAGER)
    followed = FollowedDecision(earlier)
    show_in_report([module], followed)
    return followed


class CompilePayoff:
    """Times a module's compiled regions against eager (and ``candidates``) over its own
    steps and keeps the fastest (see the module docstring). ``at_step_boundary`` after
    every optimizer step from the first compiled one on; it returns the decision once,
    when made (then also ``decision``)."""

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

    def end(self) -> Undecided | None:
        """The run ends: where it ended before the decision (mid-turn), the regions run
        compiled again, not the way that turn left them, and the region report says how
        far the gate got (``Undecided``, returned; None where decided or never begun)."""
        if self.decision is not None or not self.phases:
            return None
        self._use(COMPILED)
        self.cuda_graphs = False
        steps = sum(phase.steps for phase in self.phases)
        needed = sum(phase.settle + 2 * WINDOW * phase.windows for phase in self.phases)
        undecided = Undecided(steps, needed)
        show_in_report(self._modules, undecided)
        return undecided

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
        if self.decision is not None:
            return None
        timed = [module for module in modules if tracker_of(module) is not None]
        if not timed:
            return None
        self._modules = timed
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
        way = phase.way_of(phase.marks)  # the way of the step this boundary begins
        phase.clock.mark(way)
        if phase.at_window_end:
            # every process times the same windows: another unless all saw the turns agree
            agreed = processes.reduce_boolean_decision(phase.agrees(), all=True)
            if agreed or phase.windows == MAX_WINDOWS:
                phase.finished = True
            else:
                phase.windows += 1
        if not phase.done:
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
        show_in_report(self._modules, self.decision)
        return self.decision

    def _skip_static_shape_candidates(self) -> None:
        """CUDA graphs record one graph per shape: not tried where the batches' shapes
        varied in the turns against eager."""
        first = self.phases[0]
        if first.clock is None or len(first.clock.shapes()) < 2:
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
        agreed = agreed_over_processes([phase.records() for phase in self.phases], processes)
        against_eager = first.result(agreed[0])
        compiled_ms, eager_ms = against_eager.incumbent_ms, against_eager.challenger_ms
        best_way, best_ms = COMPILED, compiled_ms
        figures = []
        for phase, steps in zip(tried, agreed[1:], strict=True):
            faster, scaled = False, best_ms
            if phase.skipped:
                figures.append(Figure(phase.challenger, None, "; ".join(phase.notes), False))
            else:
                result = phase.result(steps)  # compiled again, in turns
                notes = phase.notes + result.notes()
                notes += [timed_again(phase.windows, WINDOW)] if phase.windows > 1 else []
                ms = result.challenger_ms
                figures.append(Figure(phase.challenger, ms, "; ".join(notes), phase.counts))
                # on the first phase's scale, beside eager's
                scaled = ms * compiled_ms / result.incumbent_ms
                faster = phase.counts and scaled <= (1 - EDGE) * best_ms
            # every process calls each reduction, whatever it skipped, so none waits alone
            if processes.reduce_boolean_decision(faster, all=True):
                best_way, best_ms = phase.challenger, scaled
        kept = processes.reduce_boolean_decision(best_ms <= (1 - EDGE) * eager_ms, all=True)
        chosen = best_way if kept else EAGER
        return PayoffDecision(against_eager, chosen, tuple(figures), WINDOW)


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


#: Where each step's agreed figures sit in ``agreed_over_processes``' all-reduce.
_ELEMENTS, _UNKNOWN, _COMPILED, _COLLECTED = range(4)


def agreed_over_processes(
    phases: list[list[TimedStep]], processes: Processes
) -> list[list[TimedStep]]:
    """Each phase's timed steps as the job ran them: a synchronous step (DDP's gradient
    all-reduce) takes about as long as its slowest rank's, so a step's batch elements are
    the largest over the processes (the rank with the most work), and a step compiled (or
    collected garbage) where any process did in it (the others waited). A phase where
    any process lacks a step's size comes back with sizes all None (compared unscaled).
    One all-reduce (a maximum) of every phase at once, which every process makes alike;
    as they are in one process."""
    world = getattr(processes, "world_size", 1)
    if world <= 1 or not torch.distributed.is_initialized():
        return phases
    width = 2 * WINDOW * MAX_WINDOWS  # room for a phase's every window
    table = torch.zeros(len(phases), width, 4, dtype=torch.int64)
    for p, steps in enumerate(phases):  # as many steps on every process, or none
        for s, step in enumerate(steps):
            table[p, s, _ELEMENTS] = step.elements or 0
            table[p, s, _UNKNOWN] = int(step.elements is None)
            table[p, s, _COMPILED] = int(step.left_out == COMPILED_IN_STEP)
            table[p, s, _COLLECTED] = int(step.left_out == COLLECTED_IN_STEP)
    table = table.to(processes.root_device)
    torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
    values = table.tolist()
    agreed = []
    for p, steps in enumerate(phases):
        rows = values[p][: len(steps)]
        unknown = any(row[_UNKNOWN] for row in rows)
        agreed.append(
            [
                replace(
                    step,
                    elements=None if unknown else row[_ELEMENTS],
                    left_out=COMPILED_IN_STEP
                    if row[_COMPILED]
                    else COLLECTED_IN_STEP
                    if row[_COLLECTED]
                    else None,
                )
                for step, row in zip(steps, rows, strict=True)
            ]
        )
    return agreed


def _reserved(device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` (0 elsewhere)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
