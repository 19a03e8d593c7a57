"""Tensor parallel + FSDP2 on a 2x2 mesh (4 CPU processes over gloo), sharded by the
user in ``configure_model`` as torchtitan does (TP on q/k/v, the MLP and both
projections, then ``fully_shard`` per block): ``RegionalCompileFSDPStrategy`` compiles
the TP-sharded blocks, one graph for the block class, and its losses equal plain
``ModelParallelStrategy``'s. One ``torchrun`` of ``tests/tp_run.py`` runs both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import launch_env

SCRIPT = Path(__file__).parent / "tp_run.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("tp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    subprocess.run([*command, str(SCRIPT), str(out)], check=True, env=launch_env(), timeout=600)
    return {
        mode: [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in range(4)]
        for mode in ("plain", "regional")
    }


@pytest.mark.ddp
def test_tp_and_fsdp2_on_a_2x2_mesh_equal_plain_model_parallel(runs):
    plain, regional = runs["plain"], runs["regional"]
    for rank in range(4):
        assert regional[rank]["mesh"] == plain[rank]["mesh"] == (2, 2)
        assert regional[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
    # a tensor-parallel pair sees one batch; the two data-parallel ranks see two
    assert regional[0]["losses"] == regional[1]["losses"] != regional[2]["losses"]


@pytest.mark.ddp
def test_the_tp_sharded_blocks_compile_as_one_graph_and_the_tie_stays(runs):
    for rank in runs["regional"]:
        assert rank["regions"] == 4 and rank["graphs"] == 1
        assert rank["never_ran_compiled"] == 0
        assert rank["tie"] and rank["broken"] == []
