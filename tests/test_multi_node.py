"""Two simulated nodes, as Lightning runs them (``num_nodes=2``, ``NODE_RANK``, one process
each, node-local caches; ``tests/nodes_run.py``), with blocks of about 1M parameters that
DDP's gradient buckets cut: DDP and FSDP2 train as plain Lightning does, the tie check
passes, DDP's graph split is reported as what it is, one compile serves the whole job,
a resume on cold nodes is warm on each, every rank takes the one keep-or-revert
decision, and the faults (artifacts refused on one node, a
slow child, a dead child) leave the job training, warned once, nothing running. Two nodes
of two processes (slow-marked): DDP as plain Lightning, and one compile for all four."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PAYOFF_STEPS
from processes import run_nodes

SCRIPT = Path(__file__).parent / "nodes_run.py"
EAGER_SCENARIOS = ["plain_ddp", "regional_ddp", "split_ddp", "graph_break_ddp"]
GATE_SCENARIOS = ["gate_plain", "gate_ddp"]
FSDP_SCENARIOS = ["fsdp_plain", "fsdp_regional"]
INDUCTOR_SCENARIOS = ["background", "resume", "fsdp_resume", "refused"]
FAULT_SCENARIOS = ["slow", "dead"]  # the child stopped early; the fallback on aot_eager

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nodes")
    scenarios = (
        EAGER_SCENARIOS + GATE_SCENARIOS + FSDP_SCENARIOS + INDUCTOR_SCENARIOS + FAULT_SCENARIOS
    )
    run_nodes([sys.executable, str(SCRIPT), str(out), "1", *scenarios], timeout=1500)
    return out


def ranks(out: Path, scenario: str, world: int = 2) -> list[dict[str, Any]]:
    return [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(world)]


def ours(result: dict[str, Any], category: str) -> list[str]:
    return [w for w in result["warnings"] if w.startswith(category)]


def test_ddp_across_nodes_trains_as_plain_lightning_with_regions_whole(nodes):
    plain, regional = ranks(nodes, "plain_ddp"), ranks(nodes, "regional_ddp")
    for rank in range(2):
        assert regional[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        assert regional[rank]["ties_intact"] and plain[rank]["ties_intact"]
        # DDP's buckets would cut these blocks; the strategy keeps each region one graph
        assert regional[rank]["pieces"] == [] and regional[rank]["breaks"] == []
        assert regional[rank]["ran_eager"] == 0 and regional[rank]["warnings"] == []


def test_a_ddp_split_the_user_asked_for_is_reported_as_pieces_never_as_a_graph_break(nodes):
    for result in ranks(nodes, "split_ddp"):
        assert result["pieces"] and result["pieces"][0] >= 2  # one graph, several pieces
        assert result["breaks"] == [] and result["warnings"] == []
    plain = ranks(nodes, "plain_ddp")
    assert ranks(nodes, "split_ddp")[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)


def test_a_real_graph_break_inside_a_region_under_ddp_is_still_warned(nodes):
    for result in ranks(nodes, "graph_break_ddp"):
        assert result["breaks"] == [2]
        assert len(ours(result, "RegionGraphBreakWarning")) == 1


def test_every_rank_across_nodes_takes_one_keep_or_revert_decision(nodes):
    """Node 0's compiled calls slowed, node 1 lenient (it would keep compiled alone): the
    decision agreed over the whole job reverts both, and training equals plain DDP's."""
    plain = ranks(nodes, "gate_plain")
    for rank, result in enumerate(ranks(nodes, "gate_ddp")):
        assert result["decision"] == "eager", result["said"]
        assert result["blocks_compiled"] == [False] * 4
        assert result["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        assert len(result["losses"]) == PAYOFF_STEPS and result["ties_intact"]


def test_fsdp2_across_nodes_trains_as_plain_lightning(nodes):
    plain, regional = ranks(nodes, "fsdp_plain"), ranks(nodes, "fsdp_regional")
    for rank in range(2):
        assert regional[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        assert regional[rank]["ties_intact"] and regional[rank]["ran_eager"] == 0


@pytest.mark.inductor
def test_one_compile_serves_the_whole_job(nodes):
    node0, node1 = ranks(nodes, "background")
    assert node0["children"] == 1 and node1["children"] == 0  # one child in the job
    assert node0["steps_eager"] == node1["steps_eager"] >= 1  # one step for the switch
    for result in (node0, node1):
        counts = result["counts"]["after_switch"]
        assert counts["fx_graph_misses"] == 0 and counts["aot_autograd_misses"] == 0, counts
        assert counts["fx_graph_hits"] >= 2 and result["running"] == []
        assert result["warnings"] == [] and result["ties_intact"]
        # every node lends half its threads while the job's child compiles, not only node 0
        (after,) = result["threads"]["after"]
        assert result["threads"]["before the switch"] == [max(1, after // 2)]
    default = ranks(nodes, "resume")  # its first run: the default mode, from a cold start
    for rank, result in enumerate((node0, node1)):
        assert result["losses"][:4] == pytest.approx(default[rank]["first_losses"], rel=1e-4)


@pytest.mark.inductor
@pytest.mark.parametrize("scenario", ["resume", "fsdp_resume"])
def test_a_resume_on_cold_nodes_is_warm_on_every_node(nodes, scenario):
    for result in ranks(nodes, scenario):
        counts = result["resumed_counts"]
        assert counts["fx_graph_hits"] >= 2 and counts["fx_graph_misses"] == 0, counts
        assert result["warnings"] == []


@pytest.mark.inductor
def test_artifacts_refused_on_one_node_warn_there_once_and_it_compiles_itself(nodes):
    node0, node1 = ranks(nodes, "refused")
    assert node0["warnings"] == [] and node0["counts"]["after_switch"]["fx_graph_misses"] == 0
    refused = ours(node1, "CacheArtifactsIgnoredWarning")
    assert len(refused) == 1 and "not signed with this user's key" in refused[0]
    assert node1["counts"]["after_switch"]["fx_graph_misses"] >= 2  # compiled itself, cold
    assert node0["steps_eager"] == node1["steps_eager"] and node1["ran_eager"] == 0


@pytest.mark.parametrize("scenario", FAULT_SCENARIOS)
def test_a_slow_or_dead_child_warns_once_on_each_node_and_the_job_trains_on(nodes, scenario):
    node0, node1 = ranks(nodes, scenario)
    assert node0["steps_eager"] == node1["steps_eager"]
    for result in (node0, node1):
        warned = ours(result, "BackgroundCompileWarning")
        assert len(warned) == 1 and result["warnings"] == warned
        cause = "background_timeout_s=0.5" if scenario == "slow" else "killed by signal 9"
        assert cause in warned[0] and result["running"] == [] and result["ran_eager"] == 0


@pytest.mark.slow
def test_two_nodes_of_two_processes_train_as_plain_lightning(tmp_path):
    run_nodes([sys.executable, str(SCRIPT), str(tmp_path), "2", "plain_ddp", "regional_ddp"])
    plain, regional = ranks(tmp_path, "plain_ddp", 4), ranks(tmp_path, "regional_ddp", 4)
    for rank in range(4):
        assert regional[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        assert regional[rank]["ties_intact"] and regional[rank]["warnings"] == []


@pytest.mark.slow
@pytest.mark.inductor
def test_one_compile_serves_two_nodes_of_two_processes(tmp_path):
    run_nodes([sys.executable, str(SCRIPT), str(tmp_path), "2", "background"], timeout=1500)
    processes = ranks(tmp_path, "background", 4)
    assert [result["children"] for result in processes] == [1, 0, 0, 0]  # one in the job
    assert len({result["steps_eager"] for result in processes}) == 1  # one switch step
    for result in processes:
        counts = result["counts"]["after_switch"]
        assert counts["fx_graph_misses"] == 0 and counts["fx_graph_hits"] >= 2, counts
        assert result["warnings"] == [] and result["running"] == []
        # rank 1 shares node 0 with the child: it lends half its threads too
        (after,) = result["threads"]["after"]
        assert result["threads"]["before the switch"] == [max(1, after // 2)]
