"""Diagnoses that are right on real model families: variants built into a model are
known from the plan and reported, not warned about; graph breaks inside regions are
warned with torch's reason and a fix that was measured; regions never called are not
regions that ran eager; locations are the real files.

Every family is built from its config at 12 layers with tiny widths and no dropout
(a compiled graph draws dropout masks differently from eager), trained 3 steps through
a real Trainer under ``backend="aot_eager"`` and compared with plain Lightning."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import transformers
from helpers import gpt2, trainer
from torch import nn

from benchmarks.tiny_transformers import tiny
from lightning_regions import (
    PerInstanceRecompileWarning,
    RegionalCompileStrategy,
    RegionGraphBreakWarning,
    RegionNotCompiledWarning,
    compile_regions,
    find_regions,
    region_report,
)
from lightning_regions.core.graph import compress_paths
from lightning_regions.core.variants import find_variants
from lightning_regions.diagnosis.judge import real_location

VOCAB = 64
DEPTH = 12  # a real depth: 2-layer models hide per-layer recompiles


def t5() -> nn.Module:
    config = tiny(
        transformers.T5Config,
        width=32,
        heads=2,
        vocab=VOCAB,
        depth=DEPTH,
        d_kv=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def modernbert() -> nn.Module:
    config = tiny(
        transformers.ModernBertConfig,
        width=32,
        heads=2,
        vocab=VOCAB,
        depth=DEPTH,
        positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return transformers.ModernBertForMaskedLM(config)


def with_experts(config, experts: str):
    config._experts_implementation = experts  # what from_pretrained(experts_implementation=)
    return config


def deepseek(experts: str = "batched_mm") -> nn.Module:
    config = tiny(
        transformers.DeepseekV3Config,
        width=32,
        heads=2,
        vocab=VOCAB,
        depth=DEPTH,
        positions=64,
        v_head_dim=8,
    )  # first_k_dense_replace=3 by default: layers 0-2 dense, the rest MoE
    return transformers.DeepseekV3ForCausalLM(with_experts(config, experts))


def mixtral(experts: str) -> nn.Module:
    config = tiny(
        transformers.MixtralConfig, width=32, heads=2, vocab=VOCAB, depth=DEPTH, positions=64
    )
    return transformers.MixtralForCausalLM(with_experts(config, experts))


def xlm() -> nn.Module:
    config = tiny(transformers.XLMConfig, width=32, heads=2, vocab=VOCAB, depth=DEPTH, positions=64)
    return transformers.XLMWithLMHeadModel(config)


class LM(pl.LightningModule):
    def __init__(self, build) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build()
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(tmp_path, build, strategy) -> tuple[LM, list[warnings.WarningMessage]]:
    module = LM(build)
    torch.manual_seed(1)
    tokens = torch.randint(3, VOCAB, (6, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, strategy, 3).fit(
            module, torch.utils.data.DataLoader(tokens, batch_size=2)
        )
    return module, list(caught)


def ours_against_plain(tmp_path, build, **strategy) -> tuple[LM, list[str]]:
    """Train ``build()`` under the strategy and under plain Lightning: losses equal;
    returns our module and our warnings of lightning_regions' categories."""
    ours, caught = fit(tmp_path, build, RegionalCompileStrategy(backend="aot_eager", **strategy))
    plain, _ = fit(tmp_path, build, "auto")
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
    ours_only = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if w.category.__module__.startswith("lightning_regions")
    ]
    return ours, ours_only


# --- variants, from the plan alone ---------------------------------------------------


def variants_of(model: nn.Module, class_name: str) -> list[tuple[str, tuple]]:
    found = find_variants(find_regions(model))[class_name]
    return [(compress_paths(v.paths), dict(v.differences)) for v in found.variants]


def test_t5_has_two_variants_per_stack_block_0_owning_the_bias():
    (enc0, enc0_diff), (enc, enc_diff), (dec0, _), (dec, _) = variants_of(t5(), "T5Block")
    assert (enc0, enc, dec0, dec) == (
        "encoder.block.0",
        "encoder.block.1-11",
        "decoder.block.0",
        "decoder.block.1-11",
    )
    bias = "layer.0.SelfAttention.relative_attention_bias"
    assert enc0_diff[bias] == "Embedding" and enc_diff[bias] == "absent"


def test_modernbert_layer_0_and_the_attention_pattern_are_variants():
    found = dict(variants_of(modernbert(), "ModernBertEncoderLayer"))
    assert found["model.layers.0"]["attn_norm"] == "Identity"
    assert found["model.layers.3,6,9"]["attention_type"] == "'full_attention'"
    assert found["model.layers.1-2,4-5,7-8,10-11"]["attention_type"] == "'sliding_attention'"


def test_deepseek_dense_and_moe_layers_are_two_variants():
    assert variants_of(deepseek(), "DeepseekV3DecoderLayer") == [
        ("model.layers.0-2", {"mlp": "DeepseekV3MLP"}),
        ("model.layers.3-11", {"mlp": "DeepseekV3MoE"}),
    ]


class Indexed(nn.Module):
    def __init__(self, index: int, rate: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layer_idx, self.rate = index, rate


class Stacks(nn.Module):
    """Two stacks whose blocks have an index each (repeated across the stacks) and a
    per-layer rate: per-instance numbers, not variants."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(Indexed(i, 0.1 * i) for i in range(DEPTH))
        self.second = nn.ModuleList(Indexed(i, 0.1 * i) for i in range(DEPTH))


def test_per_instance_numbers_are_not_variants():
    assert variants_of(Stacks(), "Indexed") == [("first.0-11, second.0-11", {})]


def test_paths_compress_into_ranges():
    paths = [f"layers.{i}" for i in (0, 1, 2, 5, 7, 8)] + ["head"]
    assert compress_paths(paths) == "layers.0-2,5,7-8, head"


# --- through a real Trainer at 12 layers ---------------------------------------------


@pytest.mark.parametrize(
    ("build", "class_name", "variants"),
    [
        (t5, "T5Block", 4),
        (modernbert, "ModernBertEncoderLayer", 3),
        (deepseek, "DeepseekV3DecoderLayer", 2),
    ],
    ids=["t5", "modernbert", "deepseek_v3"],
)
def test_variants_built_into_a_family_are_reported_not_warned(
    tmp_path, build, class_name, variants
):
    ours, warned = ours_against_plain(tmp_path, build)
    assert warned == []  # no per-instance, graph-break or not-compiled warning
    report = region_report(ours)
    (listed,) = [v for v in report.variants if v.class_name == class_name]
    assert len(listed.variants) == variants
    # each variant has a compiled entry of its own: one graph per variant, none judged
    # per instance, since no instance compiled a graph beside its variant's
    assert not [e for e in report.per_instance if e.class_name == class_name]
    graphs = sum(row.graphs for row in report.rows if row.class_name == class_name)
    assert 1 < graphs <= variants  # the training graph of each variant
    assert f"variants of {class_name}" in str(report)
    assert not report.ran_eager


def test_moe_experts_that_break_the_graph_are_warned_with_torchs_reason_and_a_fix(tmp_path):
    ours, warned = ours_against_plain(tmp_path, lambda: mixtral("eager"))
    (message,) = [w for w in warned if w.startswith("RegionGraphBreakWarning")]
    assert "MixtralDecoderLayer (model.model.layers.0-11)" in message
    assert "aten.nonzero.default" in message  # torch's own reason
    assert "experts_implementation to 'batched_mm'" in message and "top_k" in message
    (entry,) = region_report(ours).breaks
    assert entry.graphs_per_call > 1
    assert "GRAPH BREAKS in MixtralDecoderLayer" in str(region_report(ours))


def test_the_measured_fix_compiles_each_layer_in_one_graph(tmp_path):
    ours, warned = ours_against_plain(tmp_path, lambda: mixtral("batched_mm"))
    report = region_report(ours)
    assert warned == [] and report.breaks == () and report.graphs == 1


def test_a_kv_cache_that_cannot_be_turned_off_names_the_fix_that_works(tmp_path):
    _, warned = ours_against_plain(tmp_path, xlm)
    (message,) = [w for w in warned if w.startswith("PerInstanceRecompileWarning")]
    assert "XLMWithLMHeadModel builds a KV cache in every forward" in message
    assert "regions=['LayerNorm', 'TransformerFFN']" in message
    fixed, warned = ours_against_plain(tmp_path, xlm, regions=["LayerNorm", "TransformerFFN"])
    assert warned == [] and not region_report(fixed).ran_eager


class WithVision(pl.LightningModule):
    """Text layers that train, vision layers a text-only step never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.vision = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.text:
            x = x + layer(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_regions_never_called_are_reported_as_not_called_not_warned(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    module = WithVision()
    loader = torch.utils.data.DataLoader([(torch.randn(8),) for _ in range(8)], batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionNotCompiledWarning)
        strategy = RegionalCompileStrategy(backend="aot_eager")
        trainer(tmp_path, strategy, 2, limit_val_batches=None).fit(module, loader)
    report = region_report(module)
    assert [row.paths[0] for row in report.never_called] == ["vision.0", "vision.1", "vision.2"]
    assert not report.ran_eager
    assert "3 region(s) not called in the first step (nothing ran eager there): vision.0-2" in (
        caplog.text
    )


def test_torchs_cut_locations_become_the_real_files():
    real = transformers.models.t5.modeling_t5.__file__
    assert real_location("transformers/models/t5/modeling_t5.py:337 in forward") == (
        f"{real}:337 in forward"
    )
    cut = real[2:]  # torch cut a common prefix that was only part of a folder's name
    assert real_location(f"{cut}:337 in forward") == f"{real}:337 in forward"
    assert real_location("no/such/file.py:1 in forward") == "no/such/file.py:1 in forward"


def test_a_per_instance_number_that_grows_with_depth_is_still_warned(tmp_path):
    from helpers import LayerIndexBlock, fit_stack

    _, warned = fit_stack(
        tmp_path, lambda: [LayerIndexBlock(i) for i in range(DEPTH)], unspecialize_module_ints=False
    )
    (message,) = warned
    assert "LayerIndexBlock: 8 graph(s) from 8 of 12 instances, 4 left eager" in message


def test_the_public_names_are_the_documented_ones_and_every_warning_is_in_one_module():
    import pathlib
    import re

    import lightning_regions
    import lightning_regions.warnings as ours

    root = pathlib.Path(lightning_regions.__file__).resolve().parents[1]
    documented = (root / "README.md").read_text() + "".join(
        page.read_text() for page in sorted((root / "docs").glob("*.md"))
    )
    undocumented = [n for n in lightning_regions.__all__ if not re.search(rf"\b{n}\b", documented)]
    assert undocumented == []
    assert all(getattr(lightning_regions, name).__doc__ for name in lightning_regions.__all__)
    raised = {
        name
        for name in lightning_regions.__all__
        if isinstance(getattr(lightning_regions, name), type)
        and issubclass(getattr(lightning_regions, name), (Warning, Exception))
    }
    assert raised == set(ours.__all__)  # every class we raise, in lightning_regions.warnings
    assert all(getattr(ours, name) is getattr(lightning_regions, name) for name in ours.__all__)
    assert issubclass(RegionGraphBreakWarning, UserWarning)
    assert issubclass(PerInstanceRecompileWarning, UserWarning)


def judged(reasons: tuple[str, ...], graphs: tuple[int, ...]):
    from lightning_regions.diagnosis.judge import ClassRun, judge_recompiles

    paths = tuple(f"layers.{i}" for i in range(len(graphs)))
    run = ClassRun("Block", paths, graphs, eager=0, reasons=reasons, limit_hits=0)
    return judge_recompiles(run, None)


def test_each_kind_of_guard_compiled_symbolic_after_its_change_is_bounded():
    # inkling2's sliding layers: a layer index, then an input's size (the blocks seen so
    # far): each compiled constant once and symbolic after, 3 graphs whatever the depth
    reasons = (
        "1/0: self.layer_idx == 1  # cache_layer_idx = self.layer_idx",
        "1/1: tensor 'args[1]' size mismatch at index 2. expected 1, actual 2\n"
        "1/0: self.layer_idx == 1  # cache_layer_idx = self.layer_idx",
    )
    assert judged(reasons, (1, 1, 0, 0, 1, 0, 0)).bounded


def test_a_value_specialised_again_after_a_change_grows_with_depth():
    # a float compiled constant again by the graph made after the first change
    reasons = (
        "0/0: tensor 'x' requires_grad mismatch. expected requires_grad=0",
        "0/1: self.scale == 0.1  # (_dynamo/output_graph.py:3375 in remove_tensorify)",
    )
    assert not judged(reasons, (1, 1, 1)).bounded


def test_one_kind_of_guard_recompiling_again_grows_with_depth():
    reasons = tuple(f"0/{i}: ___check_obj_id(self.norm, {1000 + i})" for i in range(3))
    assert not judged(reasons, (1, 1, 1, 1)).bounded


@pytest.mark.parametrize("loss_type", [None, "ForCausalLM"], ids=["unset", "set"])
def test_gpt2s_unset_loss_type_break_names_the_fix_and_the_fix_removes_it(loss_type):
    # GPT2LMHeadModel's name holds no loss type, so transformers logs on every call
    # (warning_once) and dynamo breaks the graph there: compiled whole (nested), the
    # break is real, as under plain torch.compile; setting loss_type removes it.
    model = gpt2()
    if loss_type:
        model.loss_type = loss_type
    compile_regions(model, inplace=True, granularity="nested", backend="aot_eager")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    breaks = region_report(model).breaks
    if loss_type:
        assert breaks == ()
    else:
        assert [b.class_name for b in breaks] == ["GPT2LMHeadModel"]
        assert "model.loss_type = 'ForCausalLM'" in breaks[0].fix
