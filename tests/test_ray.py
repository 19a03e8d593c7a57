"""Ray Train's documented Lightning recipe (``TorchTrainer`` over 2 CPU workers,
``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback``,
``prepare_trainer``) with ``regional_strategy(RayDDPStrategy)``: losses equal Ray's own
strategy's, the regions compile on both workers, the background mode switches on both,
and nothing is left running after ``ray.shutdown()``. One local Ray cluster, in a
subprocess (``tests/ray_run.py``), runs the three modes in one ``TorchTrainer``'s
workers, the background mode first (in fresh worker processes: the child and the switch
are what a fresh process could get wrong)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import launch_env

pytest.importorskip("ray.train.lightning", reason="the .[ray] extra (make install has it)")
pytestmark = pytest.mark.ddp

SCRIPT = Path(__file__).parent / "ray_run.py"
MODES = ("background", "regional", "plain_long")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ray")
    env = launch_env() | {"RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *MODES], check=True, env=env, timeout=900
    )
    loaded = {
        mode: [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in range(2)]
        for mode in MODES
    }
    loaded["left_running"] = torch.load(out / "left_running.pt")
    return loaded


def test_ray_accepts_the_composed_strategy_and_runs_two_workers(runs):
    for mode in ("regional", "background"):
        assert [rank["strategy"] for rank in runs[mode]] == ["RegionalRayDDPStrategy"] * 2
        assert all(rank["world_size"] == 2 for rank in runs[mode])
    assert [rank["strategy"] for rank in runs["plain_long"]] == ["RayDDPStrategy"] * 2


def test_losses_equal_ray_ddp_strategy_and_regions_compile_on_both_workers(runs):
    plain, regional = runs["plain_long"], runs["regional"]
    assert not any(any(rank["compiled"]) for rank in plain)
    for rank in range(2):
        assert all(regional[rank]["compiled"])  # every block, on both workers
        assert regional[rank]["graphs"] == 1  # one graph for the block class
        steps = len(regional[rank]["losses"])
        assert regional[rank]["losses"] == pytest.approx(plain[rank]["losses"][:steps], rel=1e-5)
    for name, value in regional[0]["params"].items():  # DDP: both workers hold one model
        torch.testing.assert_close(regional[1]["params"][name], value, rtol=0, atol=0)


def test_the_background_mode_switches_on_both_workers_at_one_step(runs):
    background, plain = runs["background"], runs["plain_long"]
    assert all(rank["switched"] and all(rank["compiled"]) for rank in background)
    assert background[0]["switch_step"] == background[1]["switch_step"] is not None
    assert [len(rank["children"]) for rank in background] == [1, 0]  # one child in the job
    for rank in range(2):
        steps = len(background[rank]["losses"])
        assert steps < len(plain[rank]["losses"])  # it stopped 3 steps after the switch
        assert background[rank]["losses"] == pytest.approx(plain[rank]["losses"][:steps], rel=1e-5)


def test_nothing_is_left_running_after_ray_shutdown(runs):
    assert runs["left_running"] == []  # the workers and the background child
