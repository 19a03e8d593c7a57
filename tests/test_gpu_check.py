"""``make gpu-check`` on a machine without a GPU: one clear line, exit status 2, no
traceback; and its verdicts name a part that failed (the whole script runs small on the
CPU with ``--device cpu``, outside the suite: docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stdout.startswith("gpu-check: no CUDA GPU is present")
    assert "Traceback" not in done.stdout + done.stderr


def test_a_failed_part_is_an_error_line_and_the_others_still_judged():
    from gpu_check import verdicts

    parts = {
        "cold_starts": {"result": {"error": "timed out after 200 s"}},
        "warm_resume": {
            "result": {
                "cold": {"first_step_s": 10.0, "fxgraph_miss": 4},
                "checkpoint_artifacts": {"first_step_s": 2.0, "fxgraph_miss": 0},
            }
        },
    }
    lines = verdicts(parts)
    assert lines[0] == "ERROR cold_starts: timed out after 200 s"
    assert lines[1].startswith("PASS a resume from checkpoint artifacts starts warm: first step")


def test_the_real_models_steady_step_is_timed_after_the_gates_latest_decision():
    """The strategy's gate decides by step 54 at the latest on a GPU (compiled against
    eager, then CUDA graphs, each phase timing every window): the real models' steady
    step starts after it, so no way's steady figure holds the gate's eager turns."""
    from gpu_check import REAL_STEPS, STEADY_FROM
    from helpers import GATE_DECIDED_BY_WITH_A_CANDIDATE

    assert STEADY_FROM > GATE_DECIDED_BY_WITH_A_CANDIDATE
    assert STEADY_FROM in REAL_STEPS and REAL_STEPS[-1] - STEADY_FROM >= 40


def test_the_steady_steps_gate_runs_a_compiled_model_to_its_decision():
    """``steady_step.run_gate`` (the steady-steps part of ``make gpu-check`` and of ``make
    bench``) drives the strategy's gate over a model's own steps until it decides: a
    compiled model's regions are left as decided (passing it the model where the gate takes
    a list of modules once failed only on the machine that runs the check)."""
    from steady_step import run_gate
    from torch import nn

    from lightning_regions import compile_regions

    class Stack(nn.Module):  # a model, as the benchmarks' TinyGPT, not a container
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    compile_regions(model, inplace=True, backend="eager")
    batch = torch.randn(4, 8)

    def step() -> None:
        model(batch).sum().backward()
        model.zero_grad(set_to_none=True)

    said = run_gate(model, step, "cpu")
    assert said.endswith(("regions kept compiled", "regions reverted to eager")), said
    kept = said.endswith("kept compiled")
    compiled = [block._compiled_call_impl is not None for block in model.blocks]
    assert compiled == [kept] * 3, said
