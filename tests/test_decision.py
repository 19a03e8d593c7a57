"""The keep-or-revert gate's rules (``gate/decision.py``, and the agreement over
processes in ``gate/gate.py``), as pure functions of ``TimedStep`` records: medians at one
batch size, the steps left out, whether a window's turns agree on the edge, and every
rank seeing the same sizes and left-out steps."""

from __future__ import annotations

import os
import statistics

import pytest
import torch
from processes import free_port

from lightning_regions.gate.clock import COLLECTED_IN_STEP, COMPILED_IN_STEP, TimedStep
from lightning_regions.gate.decision import at_one_size, phase_result
from lightning_regions.gate.gate import (
    MAX_WINDOWS,
    SETTLE,
    WINDOW,
    Candidate,
    Phase,
    agreed_over_processes,
)


def test_steps_of_different_batch_sizes_are_compared_at_one_size():
    """``at_one_size``: where the eager turns drew the longer batches, the raw medians
    favour compiled, though it is 1.5x eager at every size; scaled to one size by the
    exponent found within each way's turns, the medians say 1.5x. One size, or a size
    not known, scales nothing; a step time that falls with size is not extrapolated."""
    rows = [16, 4, 48, 12, 16, 4, 48, 12]  # eager's turns first, as the gate times them
    ways = [i % 2 for i in range(8)]  # 0: eager
    ms = [n * (1.5 if way else 1.0) for n, way in zip(rows, ways, strict=True)]
    assert statistics.median(ms[1::2]) < statistics.median(ms[0::2])  # raw: "compiled"
    scaled, scaling = at_one_size(ms, rows, ways)
    assert statistics.median(scaled[1::2]) == pytest.approx(1.5 * statistics.median(scaled[0::2]))
    assert (scaling.smallest, scaling.largest, scaling.reference) == (4, 48, 12)
    assert scaling.exponent == pytest.approx(1.0)
    assert str(scaling) == "batches of 4-48 elements, each step scaled to 12 by size^1.00"
    recompiled = [*ms[:3], 50 * ms[3], *ms[4:]]  # one slow compiled step moves k little
    assert at_one_size(recompiled, rows, ways)[1].exponent == pytest.approx(1.0)
    assert at_one_size(ms, [8] * 8, ways) == (ms, None)
    assert at_one_size(ms, [*rows[:7], None], ways) == (ms, None)
    falling = [1 / n for n in rows]
    assert at_one_size(falling, rows, ways)[1].exponent == 0.0


def steps_of(
    ms: list[float],
    phase: Phase,
    compiled: set[int] = frozenset(),
    collected: set[int] = frozenset(),
) -> list[TimedStep]:
    """Timed steps of ``phase`` that took ``ms`` (the challenger's turn first), those at
    ``compiled`` left out for compiling, at ``collected`` for a full collection."""
    reasons = {i: COMPILED_IN_STEP for i in compiled} | {i: COLLECTED_IN_STEP for i in collected}
    return [TimedStep(phase.way_of(i), t, None, reasons.get(i)) for i, t in enumerate(ms)]


def phase_of(ms: list[float], candidate: Candidate | None = None) -> Phase:
    """A phase of ``len(ms) // (2 * WINDOW)`` windows: compiled against eager, or
    ``candidate`` against compiled."""
    challenger = "eager" if candidate is None else candidate.name
    phase = Phase("compiled", challenger, SETTLE + 1, candidate)
    phase.windows = len(ms) // (2 * WINDOW)
    return phase


def agrees(ms: list[float], candidate: Candidate | None = None, compiled=frozenset()) -> bool:
    phase = phase_of(ms, candidate)
    return phase.agrees(steps_of(ms, phase, compiled))


def test_turns_agree_where_every_pair_in_the_last_window_falls_on_one_side_of_the_edge():
    """``Phase.agrees`` (``decision.turns_agree``): each pair of turns (the challenger's
    step, then the incumbent's) says whether the way that must win by ``EDGE`` did
    (compiled against eager; a candidate against compiled); the window's turns agree
    where every pair says the same. A pair with a step that compiled is no pair; only the
    last window's pairs count."""
    faster, slower = [10.0, 8.0] * WINDOW, [10.0, 12.0] * WINDOW  # eager's turn first
    assert agrees(faster) and agrees(slower)
    assert agrees([10.0, 9.95] * WINDOW)  # 0.5% faster in all: never by the edge
    one_off = [10.0, 8.0, 10.0, 8.0, 10.0, 12.0, 10.0, 8.0]
    assert not agrees(one_off)
    assert agrees(one_off, compiled={5})  # timed step 5 compiled
    assert agrees(one_off + faster) and not agrees(faster + one_off)
    candidate = Candidate("graphs", {})  # its turn first; it must win against compiled
    assert agrees([8.0, 10.0] * WINDOW, candidate)
    assert not agrees([8.0, 10.0, 12.0, 10.0] * (WINDOW // 2), candidate)


def test_steps_that_compiled_or_collected_are_left_out_unless_a_way_would_have_none():
    """Two of compiled's four timed steps recompiled: counted, compiled's median is
    eager's 25x; left out, it is its own steps' 0.5x, and the result says how many were
    left out; one that ran a full garbage collection is left out the same way, and said
    apart. Where every step of one way compiled, all count."""
    ms = [10.0, 5.0, 10.0, 500.0, 10.0, 700.0, 10.0, 5.0]
    phase = phase_of(ms)
    counted = phase.result(steps_of(ms, phase))
    assert (counted.incumbent_ms, counted.challenger_ms) == pytest.approx((252.5, 10.0))
    left_out = phase.result(steps_of(ms, phase, compiled={3, 5}))
    assert (left_out.incumbent_ms, left_out.challenger_ms) == pytest.approx((5.0, 10.0))
    assert left_out.uncounted == 2 and left_out.notes() == [
        "2 timed steps that compiled not counted"
    ]
    collected = phase.result(steps_of(ms, phase, compiled={3}, collected={5}))
    assert (collected.incumbent_ms, collected.challenger_ms) == pytest.approx((5.0, 10.0))
    assert (collected.uncounted, collected.collected) == (1, 1)
    expected = "1 timed step that compiled and 1 step with a full garbage collection not counted"
    assert collected.notes() == [expected]
    every = phase_result(steps_of(ms, phase, compiled={1, 3, 5, 7}), "compiled", "eager")
    assert (every.incumbent_ms, every.challenger_ms) == pytest.approx((252.5, 10.0))
    assert every.uncounted == 0 and every.notes() == []


class TwoGlooProcesses:
    """What ``agreed_over_processes`` asks of a strategy, in a process of two."""

    world_size = 2
    root_device = torch.device("cpu")


def timed(elements: list, compiled: list[bool], collected: list[bool]) -> list[TimedStep]:
    """A phase's timed steps on one rank: their elements, and which compiled or
    collected (a compile is said first); each step's milliseconds are its index."""
    reasons = [
        COMPILED_IN_STEP if c else COLLECTED_IN_STEP if g else None
        for c, g in zip(compiled, collected, strict=True)
    ]
    ways = ["eager", "compiled"] * (len(elements) // 2)
    return [
        TimedStep(w, float(i), n, r)
        for i, (w, n, r) in enumerate(zip(ways, elements, reasons, strict=True))
    ]


def agreed_on_rank(rank: int, port: int, phases_by_rank: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        agreed = agreed_over_processes(phases_by_rank[rank], TwoGlooProcesses())
        own = [[(s.way, s.ms) for s in steps] for steps in phases_by_rank[rank]]
        assert [[(s.way, s.ms) for s in steps] for steps in agreed] == own  # its own times
        steps = [
            (
                [s.elements for s in steps],
                [s.left_out == COMPILED_IN_STEP for s in steps],
                [s.left_out == COLLECTED_IN_STEP for s in steps],
            )
            for steps in agreed
        ]
        torch.save(steps, os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.ddp
def test_every_rank_scales_by_the_largest_batch_and_leaves_out_any_rank_s_compiles(tmp_path):
    """A synchronous DDP step takes about as long as its slowest rank's: every rank's
    gate sees, for each timed step, the most elements any rank had, and a compile (or a
    full garbage collection) where any rank had one (one all-reduce over gloo); a phase
    that one rank lacks a size for
    is unscaled on all; one that did not run has no steps; one of several windows
    (``MAX_WINDOWS``) keeps all its steps."""
    width = 2 * WINDOW
    no, at_1, at_6 = [False] * width, [i == 1 for i in range(width)], [i == 6 for i in range(width)]
    longest = 2 * WINDOW * MAX_WINDOWS
    at_3, at_4 = [i == 3 for i in range(width)], [i == 4 for i in range(width)]
    rank0 = [
        timed([10, 40] * WINDOW, at_1, at_3),
        timed([5] * width, no, no),
        timed([], [], []),
        timed([3] * longest, [False] * (longest - 1) + [True], [False] * longest),
    ]
    rank1 = [
        timed([30, 20] * WINDOW, at_6, at_4),
        timed([5] * (width - 1) + [None], no, at_1),
        timed([], [], []),
        timed([4] * longest, [False] * longest, [False] * longest),
    ]
    args = (free_port(), [rank0, rank1], str(tmp_path))
    torch.multiprocessing.spawn(agreed_on_rank, args=args, nprocs=2)
    either, collected = [i in (1, 6) for i in range(width)], [i in (3, 4) for i in range(width)]
    last, none = [False] * (longest - 1) + [True], [False] * longest
    expected = [
        ([30, 40] * WINDOW, either, collected),
        ([None] * width, no, at_1),
        ([], [], []),
        ([4] * longest, last, none),
    ]
    assert [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)] == [expected, expected]
    assert agreed_over_processes(rank0, object()) == rank0  # one process: its own
