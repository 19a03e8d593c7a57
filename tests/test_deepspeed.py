"""DeepSpeed ZeRO stages 1-3 on two CPU processes over gloo (``tests/deepspeed_run.py``):
``RegionalCompileDeepSpeedStrategy``'s wrap hook prepares and compiles the tiny GPT, then
``deepspeed.initialize`` takes it, as under Lightning on a GPU. Each stage trains as plain
DeepSpeed does (every parameter partitioned under ZeRO-3), the tie stays one parameter,
and no DeepSpeed code runs inside a region: dynamo compiled no DeepSpeed frame, traced no
DeepSpeed line into a graph and reached no recompile limit (with ``module.compile()``,
as accelerate and DeepSpeed's ``engine.compile()`` compile a block, ZeRO-3's hooks are
traced and dynamo compiles DeepSpeed's own frames). Under ZeRO-3 the keep-or-revert gate
switches the blocks' calls mid-run and every rank takes one decision."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PAYOFF_STEPS
from processes import launch_env

pytest.importorskip("deepspeed", reason="the .[deepspeed] extra (make install has it)")
pytestmark = pytest.mark.ddp

SCRIPT = Path(__file__).parent / "deepspeed_run.py"
RUNS = (("aot_eager", 1), ("aot_eager", 2), ("aot_eager", 3), ("inductor", 3))
GATE_RUNS = (("gate-plain", 3), ("gate", 3))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("deepspeed")
    command = [sys.executable, str(SCRIPT), str(out), *(f"{b}:{s}" for b, s in RUNS + GATE_RUNS)]
    subprocess.run(command, check=True, env=launch_env() | {"DS_ACCELERATOR": "cpu"}, timeout=600)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def deepspeed_code(paths) -> list[str]:
    return [path for path in paths if f"{Path('deepspeed')}/" in (path or "")]


@pytest.mark.parametrize(("backend", "stage"), RUNS)
def test_each_zero_stage_trains_as_plain_deepspeed_with_no_deepspeed_code_in_a_region(
    ranks, backend, stage
):
    for rank in ranks:
        plain, ours = rank[None, stage], rank[backend, stage]
        assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        atol = 1e-5 if backend == "inductor" else 1e-6  # inductor's own float order
        for name, value in plain["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-4, atol=atol, msg=name)
        assert ours["tied"] and plain["tied"]
        assert ours["regions"] == 4 and ours["graphs"] == 1 and ours["never_ran_compiled"] == 0
        assert ours["leaves"] == [stage == 3] * 4  # ZeRO-3 hooks each block, nothing inside
        assert deepspeed_code(filename for _, filename in ours["frames"]) == []
        assert deepspeed_code(ours["traced_files"]) == []
        assert ours["traced_files"]  # the recording backend saw the block's code
        assert ours["recompile_limit_hits"] == []


def test_every_rank_reverts_alike_under_zero_3_and_trains_as_plain_deepspeed(ranks):
    """The keep-or-revert gate at each step of ZeRO-3, rank 0's compiled calls slowed and
    rank 1 lenient (it would keep compiled alone): both revert, the blocks' class forward
    back in place under DeepSpeed's hooks, and every step equals plain DeepSpeed's."""
    for rank in ranks:
        plain, ours = rank["gate-plain", 3], rank["gate", 3]
        assert ours["decision"] == "eager", ours["said"]
        assert ours["forwards_compiled"] == [False] * 4
        assert len(ours["losses"]) == len(plain["losses"]) == PAYOFF_STEPS
        assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        for name, value in plain["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-4, atol=1e-6, msg=name)
        assert ours["tied"] and plain["tied"]
        assert not any(key.startswith("_orig_mod") or "._orig_mod" in key for key in ours["keys"])
