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


@pytest.mark.ddp
def test_ranks_end_identical_and_equal_to_eager_ddp(tmp_path):
    regional = run_ddp("regional", tmp_path)
    eager = run_ddp("eager", tmp_path)
    assert all(rank["compiled"] for rank in regional)
    assert not any(rank["compiled"] for rank in eager)
    for name, value in regional[0]["params"].items():
        torch.testing.assert_close(regional[1]["params"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(value, eager[0]["params"][name], rtol=1e-4, atol=1e-6, msg=name)
    for rank in range(2):
        assert regional[rank]["losses"] == pytest.approx(eager[rank]["losses"], rel=1e-5)
