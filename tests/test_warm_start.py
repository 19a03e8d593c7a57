"""Warm starts in new processes with inductor: torch's own compile cache shared by runs
with different roots (a sweep), and mega-cache artifacts carried by the checkpoint to a
fresh, empty cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_regions.cache import CHECKPOINT_KEY, isa_probe_files
from lightning_regions.compat import isa_probe_sources

SCRIPT = Path(__file__).parent.parent / "examples" / "resume_run.py"


def train(
    run_dir: Path, torch_cache: Path, steps: int, ckpt: Path | None = None, key: str | None = None
) -> dict:
    """One run in a fresh process, with the user's ``TORCHINDUCTOR_CACHE_DIR`` exported
    and the strategy's defaults."""
    command = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--steps", str(steps)]
    command += ["--ckpt", str(ckpt)] if ckpt else []
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(torch_cache))
    env.update({"LIGHTNING_REGIONS_ARTIFACT_KEY": key} if key else {})
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def files_below(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.mark.inductor
def test_runs_with_other_roots_share_torchs_cache_and_checkpoints_carry_what_they_used(tmp_path):
    shared = tmp_path / "torch_cache"  # the user's TORCHINDUCTOR_CACHE_DIR
    trial_1 = train(tmp_path / "trial_1", shared, steps=2)
    trial_2 = train(tmp_path / "trial_2", shared, steps=2)  # another root, as in a sweep
    checkpoint = tmp_path / "trial_2" / "last.ckpt"  # of a run that found its graphs warm
    from_artifacts = train(tmp_path / "resumed", tmp_path / "empty", steps=3, ckpt=checkpoint)
    another_user = train(tmp_path / "other", tmp_path / "empty2", 3, checkpoint, key="other")

    assert trial_1["fxgraph_miss"] > 0 and trial_1["fxgraph_hit"] == 0
    for warm in (trial_2, from_artifacts):  # every graph served from a cache, none rebuilt
        assert warm["fxgraph_hit"] > 0 and warm["fxgraph_miss"] == 0
        assert warm["aot_hit"] > 0 and warm["aot_miss"] == 0
    assert trial_1["losses"] == trial_2["losses"]
    assert from_artifacts["losses"] == another_user["losses"]
    # another user's genuine checkpoint: its artifacts are not loaded, a cold start
    assert another_user["fxgraph_hit"] == 0
    assert another_user["fxgraph_miss"] == trial_1["fxgraph_miss"]
    # every compiled file is in the user's folder: none of ours elsewhere, none among
    # the checkpoints
    assert files_below(shared) and files_below(tmp_path / "empty")
    assert not (Path(os.environ["XDG_CACHE_HOME"]) / "lightning_regions").exists()
    assert sorted(os.listdir(tmp_path / "trial_2")) == ["epoch=1-step=2.ckpt", "last.ckpt"]
    # torch's instruction-set probes travel with the kernels, so the empty cache's first
    # kernel needs no g++ run (12.6 s here): the checkpoint holds them, they landed
    probes = isa_probe_files(str(shared))
    carried = torch.load(checkpoint, weights_only=False)[CHECKPOINT_KEY]["kernels"]
    assert probes and probes.items() <= carried.items()
    assert probes.items() <= isa_probe_files(str(tmp_path / "empty")).items()
    seconds = [run["first_step_s"] for run in (trial_1, trial_2, from_artifacts, another_user)]
    print(
        "first step (s): trial 1 {:.1f}, trial 2 (another root) {:.1f}, resumed from "
        "artifacts {:.1f}, another user's artifacts {:.1f}".format(*seconds)
    )


def test_isa_probes_are_found_by_their_source_and_kernels_are_not(tmp_path):
    probe_source = sorted(isa_probe_sources())[0]
    (tmp_path / "ab").mkdir()
    for name, source in (("cprobe", probe_source), ("ckernel", "extern void kernel();")):
        (tmp_path / "ab" / f"{name}.cpp").write_text(source)
        (tmp_path / "ab" / f"{name}.so").write_bytes(name.encode())
    (tmp_path / "ab" / "cnosource.so").write_bytes(b"a library without its source")
    assert isa_probe_files(str(tmp_path)) == {"ab/cprobe.so": b"cprobe"}
    assert isa_probe_files(str(tmp_path / "missing")) == {}
