"""Warm starts in new processes with inductor: a run-owned cache directory, and
mega-cache artifacts carried by the checkpoint to a fresh, empty directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "examples" / "resume_run.py"


def train(
    run_dir: Path, cache_dir: Path, steps: int, ckpt: Path | None = None, key: str | None = None
) -> dict:
    command = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir)]
    command += ["--cache-dir", str(cache_dir), "--steps", str(steps)]
    command += ["--ckpt", str(ckpt)] if ckpt else []
    env = dict(os.environ, **({"LIGHTNING_REGIONS_ARTIFACT_KEY": key} if key else {}))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.inductor
def test_resume_starts_warm_from_the_run_directory_and_from_checkpoint_artifacts(tmp_path):
    cold = train(tmp_path / "first", tmp_path / "cache", steps=2)
    checkpoint = tmp_path / "first" / "last.ckpt"
    warm_dir = train(tmp_path / "second", tmp_path / "cache", steps=3, ckpt=checkpoint)
    from_artifacts = train(tmp_path / "third", tmp_path / "empty", steps=3, ckpt=checkpoint)
    another_user = train(tmp_path / "fourth", tmp_path / "empty2", 3, checkpoint, key="other")

    assert cold["fxgraph_miss"] > 0 and cold["fxgraph_hit"] == 0
    for warm in (warm_dir, from_artifacts):  # every graph served from a cache, none rebuilt
        assert warm["fxgraph_hit"] > 0 and warm["fxgraph_miss"] == 0
        assert warm["aot_hit"] > 0
    assert warm_dir["losses"] == from_artifacts["losses"] == another_user["losses"]
    # another user's genuine checkpoint: its artifacts are not loaded, a cold start
    assert another_user["fxgraph_hit"] == cold["fxgraph_hit"] == 0
    assert another_user["fxgraph_miss"] == cold["fxgraph_miss"]
    seconds = [run["first_step_s"] for run in (cold, warm_dir, from_artifacts, another_user)]
    print(
        "first step (s): cold {:.1f}, warm directory {:.1f}, artifacts {:.1f}, "
        "another user's artifacts {:.1f}".format(*seconds)
    )
