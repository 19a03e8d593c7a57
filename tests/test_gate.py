"""The keep-or-revert gate (``gate/gate.py``) on scripted step times: a real
``CompilePayoff`` over a model whose regions are compiled in place, its clock the
script's. The windows, the 1% edge, a decision that never flips back, agreement over two
gloo processes, and where CUDA graphs are a candidate."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from helpers import BlockStack
from processes import free_port
from torch import nn

from lightning_regions.core.compile import compile_regions
from lightning_regions.gate import gate as payoff
from lightning_regions.gate.clock import StepClock
from lightning_regions.gate.gate import MAX_WINDOWS, SETTLE, WINDOW

#: Optimizer steps until the decision where one window's turns agree.
DECIDED_AFTER = 1 + SETTLE + 2 * WINDOW
#: ... and at most (``MAX_WINDOWS`` windows).
DECIDED_BY = 1 + SETTLE + 2 * WINDOW * MAX_WINDOWS


class OneProcess:
    """What the gate asks of a strategy, in a job of one process."""

    root_device = torch.device("cpu")

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


@contextlib.contextmanager
def scripted_clock() -> Iterator[list[float]]:
    """The gate's clock reads ``now[0]`` (seconds) instead of the wall clock."""
    now = [0.0]
    clock_now = StepClock._now
    StepClock._now = lambda self: now[0]
    try:
        yield now
    finally:
        StepClock._now = clock_now


def gate_on_scripted_steps(compiled_turns: list[float], processes=None) -> tuple:
    """A real ``CompilePayoff`` over a model whose regions are compiled in place, each step
    taking 10 ms eager and, compiled, 8 ms while settling, then ``compiled_turns`` in turn
    (the clock is the script's, the model is not run): the decision and its step."""
    model = BlockStack([nn.Linear(8, 8) for _ in range(3)])
    compile_regions(model, inplace=True, backend="eager")
    gate, turns = payoff.CompilePayoff(), iter(compiled_turns)
    with scripted_clock() as now:
        for step in range(1, 100):
            if all(block._compiled_call_impl is None for block in model.blocks):
                now[0] += 0.010
            else:
                now[0] += (next(turns) if step > 1 + SETTLE else 8.0) / 1000
            decision = gate.at_step_boundary([model], processes or OneProcess())
            if decision is not None:
                return decision, step, gate.phases[0]
    raise AssertionError("no decision")


def test_turns_that_disagree_are_timed_again_and_every_window_counts():
    """One compiled turn of four slower than eager: another window is timed, the medians
    take both, and the decision says so; turns that disagree in every window are decided
    by all ``MAX_WINDOWS``' medians, and turns that agree by one window's."""
    decision, step, phase = gate_on_scripted_steps([8.0, 8.0, 8.0, 8.0])
    assert (step, phase.windows, decision.windows, decision.chosen) == (11, 1, 1, "compiled")
    decision, step, phase = gate_on_scripted_steps([8.0, 12.0, 8.0, 8.0] + [8.0] * 4)
    assert (step, phase.windows, decision.chosen) == (11 + 2 * WINDOW, 2, "compiled")
    assert len(phase.records()) == 4 * WINDOW
    assert decision.compiled_ms == pytest.approx(8.0) and decision.eager_ms == pytest.approx(10)
    assert f"({2 * WINDOW} steps a way: turns that disagreed were timed again)" in str(decision)
    decision, step, phase = gate_on_scripted_steps([12.0, 12.0, 8.0, 12.0] * MAX_WINDOWS)
    assert (step, phase.windows, decision.chosen) == (DECIDED_BY, MAX_WINDOWS, "eager")
    assert decision.compiled_ms == pytest.approx(12.0)


class GlooProcesses(OneProcess):
    """A boolean decision that holds where it holds on every process (over gloo)."""

    world_size = 2

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag)


def scripted_gate_on_rank(rank: int, port: int, turns_by_rank: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        decision, step, phase = gate_on_scripted_steps(turns_by_rank[rank], GlooProcesses())
        torch.save((step, phase.windows, decision.chosen), os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.ddp
def test_every_rank_times_another_window_where_any_rank_s_turns_disagree(tmp_path):
    """Rank 0's turns agree, rank 1's do not: both time a second window (one all-reduce
    at each window's end), so they decide at the same step, the same way."""
    turns = [[8.0] * 8, [8.0, 12.0, 8.0, 8.0] + [8.0] * 4]
    args = (free_port(), turns, str(tmp_path))
    torch.multiprocessing.spawn(scripted_gate_on_rank, args=args, nprocs=2)
    expected = (DECIDED_AFTER + 2 * WINDOW, 2, "compiled")
    assert [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)] == [expected, expected]


def test_a_way_must_win_by_the_edge_and_the_decision_never_flips_back():
    """Compiled 0.5% faster than eager in every turn is inside ``EDGE``: eager is kept (it
    gets the edge); 2% faster is kept compiled. Once decided, the gate times nothing more
    and keeps the regions that way, whatever the steps after it take."""
    decision, step, _ = gate_on_scripted_steps([9.95] * (2 * WINDOW))
    assert (decision.chosen, step) == ("eager", DECIDED_AFTER)
    decision, step, _ = gate_on_scripted_steps([9.8] * (2 * WINDOW))
    assert (decision.chosen, step) == ("compiled", DECIDED_AFTER)
    model = BlockStack([nn.Linear(8, 8) for _ in range(3)])
    compile_regions(model, inplace=True, backend="eager")
    gate, decided = payoff.CompilePayoff(), None
    with scripted_clock() as now:
        for _step in range(1, DECIDED_BY + 20):
            compiled = any(block._compiled_call_impl is not None for block in model.blocks)
            if decided is None:  # compiled clearly faster until the decision
                now[0] += (5.0 if compiled else 10.0) / 1000
            else:  # then compiled clearly slower: nothing changes
                now[0] += (50.0 if compiled else 10.0) / 1000
            made = gate.at_step_boundary([model], OneProcess())
            decided = decided or made
            if decided is not None and made is None:
                assert gate.decision is decided and decided.chosen == "compiled"
                assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert decided is not None and gate.decision is decided


def test_cuda_graphs_are_a_candidate_only_where_known_to_be_safe():
    from lightning_regions.gate.gate import cuda_graphs_candidate
    from lightning_regions.options import RegionalOptions

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    plain = RegionalOptions()
    candidate = cuda_graphs_candidate(plain, cuda, single_process=True, plain_steps=True)
    assert candidate is not None and candidate.cuda_graphs
    assert candidate.compile_kwargs == {**plain.compile_kwargs, "mode": "reduce-overhead"}
    no_graphs = RegionalOptions(mode="max-autotune-no-cudagraphs")
    assert cuda_graphs_candidate(no_graphs, cuda, True, True).compile_kwargs["mode"] == (
        "reduce-overhead"
    )
    refused = [
        (plain, cpu, True, True),  # no CUDA
        (plain, cuda, False, True),  # several processes (DDP, FSDP) or DeepSpeed's hooks
        (plain, cuda, True, False),  # gradient accumulation
        (RegionalOptions(mode="reduce-overhead"), cuda, True, True),  # the user's own choice
        (RegionalOptions(mode="max-autotune"), cuda, True, True),  # has them already
        (RegionalOptions(backend="aot_eager"), cuda, True, True),
        (RegionalOptions(options={"max_autotune": True}), cuda, True, True),
        (RegionalOptions(granularity="nested"), cuda, True, True),
    ]
    for options, device, single, steps in refused:
        assert cuda_graphs_candidate(options, device, single, steps) is None, options
