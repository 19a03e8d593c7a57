"""Real FSDP2 over gloo on CPU, 2 processes: RegionalCompileFSDPStrategy against plain
``ModelParallelStrategy`` training the same model eagerly.

All 2-process scenarios run in one ``torchrun`` (``tests/fsdp_run.py``); each test reads
what its scenario wrote. Plain runs shard in ``configure_model()`` as Lightning's docs
show: each block, then the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import SingleBlockList
from processes import launch_env
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from examples.lightning_gpt import GPTModule
from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import RegionalCompileFSDPStrategy, find_regions
from lightning_regions.core.sharding import mixed_precision_policy, shard_by_plan

SCRIPT = Path(__file__).parent / "fsdp_run.py"
TWO_PROCESS_SCENARIOS = [
    "plain",
    "user",
    "default_mesh",
    "auto",
    "albert_plain",
    "albert_auto",
    "bf16_plain",
    "bf16_auto",
    "tie_broken",
    "per_rank_eager_fallback",
    "per_rank_recompiles",
    "fsdp1",
    "payoff_plain",
    "payoff",
    "resume_plain_sharded",
    "resume_plain_full",
    "resume_regional_sharded",
    "resume_regional_full",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    subprocess.run(
        [*command, str(SCRIPT), str(out), *TWO_PROCESS_SCENARIOS],
        check=True,
        env=launch_env(),
        timeout=600,
    )
    return out


def ranks(out: Path, scenario: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{scenario}_rank{r}.pt", weights_only=False) for r in range(2)]


def assert_same_training(ours: list[dict], plain: list[dict]) -> None:
    for rank in range(2):
        assert ours[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6, abs=1e-6)
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def assert_sharded_compiled(result: dict[str, Any]) -> None:
    assert result["block_is_dtensor"]
    assert result["block_local_numel"] * 2 == result["block_full_numel"]
    assert result["tie_is_one"]
    assert result["graphs"] >= 1  # the counting backend saw the regions' graphs
    assert result["rows"] and all(compiled_calls > 0 for _, compiled_calls in result["rows"])


@pytest.mark.ddp
def test_user_sharded_run_compiles_regions_and_equals_plain_fsdp2(runs):
    user, plain = ranks(runs, "user"), ranks(runs, "plain")
    assert_same_training(user, plain)
    for rank in user:
        assert_sharded_compiled(rank)
        assert rank["sharded_groups"] == []  # configure_model() sharded, not the strategy
    assert not plain[0]["compiled"] and plain[0]["graphs"] == 0
    assert not any("FSDPMeshWarning" in w for rank in user for w in rank["warnings"])


@pytest.mark.ddp
def test_a_default_fsdp2_mesh_wider_than_data_parallel_warns_once_with_the_fix(runs):
    """Lightning's defaults on one node give data-parallel size 1, while fully_shard's
    default mesh shards over both processes: both are fed the same batches."""
    rank0, rank1 = ranks(runs, "default_mesh")
    assert rank0["losses"] == rank1["losses"]  # the same batches on both processes: the trap
    mesh_warnings = [w for w in rank0["warnings"] if w.startswith("FSDPMeshWarning")]
    assert len(mesh_warnings) == 1  # at setup, not again for validate()
    assert "shard over 2 processes, but the data-parallel size is 1" in mesh_warnings[0]
    assert "data_parallel_size=2, tensor_parallel_size=1" in mesh_warnings[0]
    assert not any(w.startswith("FSDPMeshWarning") for w in rank1["warnings"])  # rank zero


@pytest.mark.ddp
def test_strategy_shards_by_the_plan_and_equals_plain_fsdp2(runs):
    auto, plain = ranks(runs, "auto"), ranks(runs, "plain")
    assert_same_training(auto, plain)
    for rank in auto:
        assert_sharded_compiled(rank)
        assert rank["sharded_groups"] == [
            "GPTBlock at model.blocks.0, model.layers.0",
            "GPTBlock at model.blocks.1, model.layers.1",
            "GPTBlock at model.blocks.2, model.layers.2",
            "model",
        ]
        assert rank["groups_after_validate"] == rank["sharded_groups"]
        assert 1.0 < rank["val_perplexity"] < 100.0


@pytest.mark.ddp
def test_shared_block_is_sharded_once_and_trains_as_plain(runs):
    auto, plain = ranks(runs, "albert_auto"), ranks(runs, "albert_plain")
    assert_same_training(auto, plain)
    for rank in auto:
        assert_sharded_compiled(rank)
        block_groups = [g for g in rank["sharded_groups"] if g.startswith("GPTBlock")]
        assert len(block_groups) == 1  # one block at three positions: one FSDP group
        assert rank["rows"] == [("GPTBlock", 3)]  # one region, called three times


@pytest.mark.ddp
def test_bf16_mixed_policy_and_reshard_option_equal_plain_fsdp2_with_the_same(runs):
    """precision="bf16-mixed" gives MixedPrecisionPolicy(bf16 params, fp32 reduce)."""
    auto, plain = ranks(runs, "bf16_auto"), ranks(runs, "bf16_plain")
    fp32 = ranks(runs, "plain")
    for rank in range(2):
        assert auto[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6, abs=1e-6)
        assert auto[rank]["losses"] != pytest.approx(fp32[rank]["losses"], rel=1e-6, abs=1e-6)
        assert_sharded_compiled(auto[rank])
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(auto[0]["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.ddp
def test_each_rank_falls_back_to_eager_and_keeps_the_users_cache_dir(runs):
    plain = ranks(runs, "plain")
    for rank, result in enumerate(ranks(runs, "per_rank_eager_fallback")):
        assert result["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6)
        assert result["errors"][0] == "RuntimeError: backend failed on purpose"
        assert all(calls == 0 for _, calls in result["rows"])  # eager, and reported so
        # one warning names the failed regions; the not-compiled one does not repeat them
        assert sum(w.startswith("RegionCompileWarning") for w in result["warnings"]) == 1
        assert not any(w.startswith("RegionNotCompiledWarning") for w in result["warnings"])
        expected = runs / "per_rank_eager_fallback" / "users_cache"
        assert Path(result["cache_dir"]) == expected


@pytest.mark.ddp
def test_each_rank_watches_recompiles(runs):
    for result in ranks(runs, "per_rank_recompiles"):
        assert result["recompiles"] == 1  # the sanity check's eval graph, then train mode
        storms = [w for w in result["warnings"] if w.startswith("RecompileStormWarning")]
        assert len(storms) == 1 and "GPTBlock recompiled 1 times" in storms[0]


@pytest.mark.ddp
@pytest.mark.inductor
def test_each_rank_starts_warm_from_checkpoint_artifacts(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    subprocess.run(
        [*command, str(SCRIPT), str(tmp_path), "per_rank_artifacts"],
        check=True,
        env=launch_env(),
        timeout=600,
    )
    for result in ranks(tmp_path, "per_rank_artifacts"):
        assert result["cold"]["fxgraph_miss"] > 0 and result["cold"]["fxgraph_hit"] == 0
        # an empty cache directory per rank: every graph comes from the checkpoint
        assert result["warm"]["fxgraph_hit"] == result["cold"]["fxgraph_miss"]
        assert result["warm"]["fxgraph_miss"] == 0


@pytest.mark.ddp
def test_every_rank_takes_the_same_keep_or_revert_decision_under_fsdp2(runs):
    # rank 0 measures compiled slower; rank 1, in lockstep, would keep it: they agree
    ours, plain = ranks(runs, "payoff"), ranks(runs, "payoff_plain")
    compiled_ms, eager_ms = ours[0]["ms"]
    assert compiled_ms > eager_ms
    assert ours[1]["ms"][0] < 101 * ours[1]["ms"][1]
    assert [rank["kept"] for rank in ours] == [False, False]
    assert [rank["compiled"] for rank in ours] == [False, False]
    assert [rank["tie_is_one"] for rank in ours] == [True, True]
    assert_same_training(ours, plain)


@pytest.mark.ddp
def test_tie_broken_before_sharding_raises_naming_the_head(runs):
    for rank in ranks(runs, "tie_broken"):
        assert rank["error"] == "TiedWeightsError"
        assert "model.lm_head.weight" in rank["message"]


@pytest.mark.ddp
def test_fsdp1_in_configure_model_gets_lightnings_own_error(runs):
    for rank in ranks(runs, "fsdp1"):
        assert rank["error"] == "TypeError"
        assert "FullyShardedDataParallel" in rank["message"]
        assert "FSDP2" in rank["message"]


@pytest.mark.ddp
@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_resume_matches_an_uninterrupted_run_and_plain_resume(runs, layout):
    ours = ranks(runs, f"resume_regional_{layout}")
    plain = ranks(runs, f"resume_plain_{layout}")
    for rank in range(2):
        mine = ours[rank]
        # Resumed from ModelCheckpoint's file at step 2 (an epoch's end): exact.
        assert mine["resumed"] == pytest.approx(mine["whole"][2:], rel=1e-6)
        # Resumed from trainer.save_checkpoint() after a 2-step fit: Lightning's loop
        # restarts the finished epoch and takes its 2nd batch from the next epoch, so
        # step 2 after the resume differs. Ours does exactly what plain does.
        assert mine["resumed_after_fit"][0] == pytest.approx(mine["whole"][2], rel=1e-6)
        assert mine["resumed_after_fit"][1] != pytest.approx(mine["whole"][3], rel=1e-6)
        for key in ("whole", "resumed", "resumed_after_fit"):
            assert mine[key] == pytest.approx(plain[rank][key], rel=1e-6), key
        assert mine["is_dir"] is (layout == "sharded")
    for name, value in ours[0]["whole_params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=1e-6, atol=1e-7)
    if layout == "full":
        assert ours[0]["keys"] == ours[0]["plain_keys"]  # loaded strictly into the plain model
        assert "model.lm_head.weight" in ours[0]["keys"]


@pytest.mark.ddp
def test_one_device_works_and_equals_plain_fsdp2_on_one_device(tmp_path):
    for scenario in ("devices1", "devices1_plain"):
        subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path), scenario],
            check=True,
            env=launch_env(),
            timeout=300,
        )
    ours = torch.load(tmp_path / "devices1_rank0.pt", weights_only=False)
    plain = torch.load(tmp_path / "devices1_plain_rank0.pt", weights_only=False)
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert ours["block_is_dtensor"] and ours["block_local_numel"] == ours["block_full_numel"]
    assert ours["rows"] and all(calls > 0 for _, calls in ours["rows"])
    # torch.save of the trained, sharded model ends as it does under plain FSDP2
    assert ours["torch_save"] == plain["torch_save"], (ours["torch_save"], plain["torch_save"])


def test_mixed_precision_follows_lightning_precision():
    policy = mixed_precision_policy("bf16-mixed")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("32-true") is None
    with pytest.raises(ValueError, match=r"'16-mixed'.*configure_model"):
        mixed_precision_policy("16-mixed")


@pytest.fixture
def restored_environ():
    """Lightning's launcher writes MASTER_PORT, LOCAL_RANK... into this process's
    environment; later tests that start processes must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("restored_environ", "lightning_may_set_omp_num_threads")
def test_tensor_parallel_size_without_configure_model_raises_before_any_process_group(tmp_path):
    strategy = RegionalCompileFSDPStrategy(tensor_parallel_size=2, process_group_backend="gloo")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*configure_model"):
        trainer.fit(GPTModule(n_layer=2, n_embd=8, n_head=2, block_size=8))
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def single_rank_mesh():
    """A one-process gloo group and mesh, so fully_shard runs in this process."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    yield init_device_mesh("cpu", (1,))
    torch.distributed.destroy_process_group()


def test_parameters_on_the_root_itself_raise(single_rank_mesh):
    class HoldsScale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))

    model = HoldsScale()
    with pytest.raises(ValueError, match=r"\['scale'\].*HoldsScale itself"):
        shard_by_plan(model, find_regions(model, "body"), single_rank_mesh)
    assert not isinstance(model.body, FSDPModule)  # raised before sharding anything


def test_children_sharing_a_parameter_form_one_group(single_rank_mesh):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    groups = shard_by_plan(model, find_regions(model, "blocks.*"), single_rank_mesh)
    assert groups[-1] == "embed + head"
    assert model.head.weight is model.embed.weight
    assert isinstance(model.embed, FSDPModule) and isinstance(model.head, FSDPModule)
    assert not isinstance(model, FSDPModule)  # never the root


def test_a_child_tying_two_groups_merges_them(single_rank_mesh):
    class ThreeTied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.c = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
            self.c[0].weight, self.c[1].weight = self.a.weight, self.b.weight
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    model = ThreeTied()
    groups = shard_by_plan(model, find_regions(model, "blocks.*"), single_rank_mesh)
    assert groups[-1] == "a + b + c"
    assert model.c[0].weight is model.a.weight and model.c[1].weight is model.b.weight


def test_a_parameter_shared_by_a_region_and_a_child_raises(single_rank_mesh):
    class SharedWithBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.head = torch.nn.Linear(4, 4)
            self.head.weight = self.blocks[0].weight

    model = SharedWithBlock()
    with pytest.raises(ValueError, match=r"'head' holds a parameter that Linear at blocks\.0"):
        shard_by_plan(model, find_regions(model, "blocks.*"), single_rank_mesh)
    assert not isinstance(model.blocks[0], FSDPModule)  # raised before sharding anything

    class TiedBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.blocks[1].weight = self.blocks[0].weight

    model = TiedBlocks()
    with pytest.raises(ValueError, match=r"Linear at blocks\.1 \(weight\) holds a parameter"):
        shard_by_plan(model, find_regions(model, "blocks.*"), single_rank_mesh)


def test_regions_are_found_by_the_models_own_class_after_fully_shard(single_rank_mesh):
    """fully_shard swaps in an FSDP<Class> subclass made in torch's module: selectors,
    reasons and the one-block rule still see the model's class."""
    model = TinyGPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8))
    for block in model.blocks:
        fully_shard(block, mesh=single_rank_mesh)
    assert type(model.blocks[0]).__name__ == "FSDPGPTBlock"
    plan = find_regions(model, "GPTBlock")
    assert [region.class_name for region in plan.regions] == ["GPTBlock"] * 3
    assert "repeated GPTBlock" in find_regions(model).regions[0].reason

    looped = SingleBlockList()
    fully_shard(looped.groups[0], mesh=single_rank_mesh)
    (region,) = find_regions(looped).regions
    assert region.module is looped.groups[0]
