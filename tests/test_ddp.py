"""Real 2-process DDP over gloo: regional compile under DDP equals eager DDP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import launch_env

SCRIPT = Path(__file__).parent / "ddp_run.py"


def run_ddp(mode: str, out: Path) -> list[dict]:
    command = [sys.executable, str(SCRIPT), mode, str(out)]
    subprocess.run(command, check=True, env=launch_env(), timeout=300)
    return [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[dict]:
    return run_ddp("eager", tmp_path_factory.mktemp("eager"))


@pytest.mark.ddp
@pytest.mark.parametrize("mode", ["regional", "nested"])
def test_ranks_end_identical_and_equal_to_eager_ddp(tmp_path, eager, mode):
    regional = run_ddp(mode, tmp_path)
    assert all(rank["compiled"] for rank in regional)
    assert not any(rank["compiled"] for rank in eager)
    for name, value in regional[0]["params"].items():
        torch.testing.assert_close(regional[1]["params"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(value, eager[0]["params"][name], rtol=1e-4, atol=1e-6, msg=name)
    for rank in range(2):
        assert regional[rank]["losses"] == pytest.approx(eager[rank]["losses"], rel=1e-5)
        assert regional[rank]["saved_loads_equal"] and eager[rank]["saved_loads_equal"]
    if mode == "nested":  # 3 positions, 2 distinct blocks: every call nested in the graph
        assert all(rank["nested_calls"] == 3 for rank in regional), regional[0]["nested_calls"]
        assert all(rank["never_ran_compiled"] == 0 for rank in regional)


@pytest.mark.ddp
def test_background_compile_runs_one_child_and_switches_every_rank_at_one_step(tmp_path):
    background = run_ddp("background", tmp_path)
    eager_long = run_ddp("eager_long", tmp_path)
    assert all(rank["switched"] and not rank["child_left"] for rank in background)
    assert background[0]["steps_eager"] == background[1]["steps_eager"] >= 1
    assert [rank["children"] for rank in background] == [1, 0]  # one child in the whole job
    assert all(rank["compiled"] for rank in background)
    for rank in background:  # both ranks lend half their threads to rank 0's child
        (after,) = rank["threads"]["after"]
        assert rank["threads"]["before the switch"] == {max(1, after // 2)}
    for rank in range(2):
        assert background[rank]["losses"] == pytest.approx(eager_long[rank]["losses"], rel=1e-5)
    # 120 AdamW steps: a parameter whose gradient is near zero moves by about lr a step
    # whatever its float noise, so aot_eager's last bits show there (1.5e-4 seen on torch
    # 2.11 when the switch came at step 15); the losses above are equal to 1e-5
    for name, value in background[0]["params"].items():
        torch.testing.assert_close(background[1]["params"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(value, eager_long[0]["params"][name], rtol=1e-4, atol=1e-3)


@pytest.mark.ddp
def test_every_rank_takes_the_same_keep_or_revert_decision(tmp_path):
    # rank 0 measures compiled slower (its backend sleeps); rank 1, in lockstep, measures
    # alike but keeps compiled unless it is 101x slower: alone they would part ways
    ranks = run_ddp("payoff", tmp_path)
    assert ranks[0]["compiled_ms"] > ranks[0]["eager_ms"]
    assert ranks[1]["compiled_ms"] < 101 * ranks[1]["eager_ms"]
    assert [rank["kept"] for rank in ranks] == [False, False]
    assert [rank["compiled"] for rank in ranks] == [False, False]
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0, msg=name)
