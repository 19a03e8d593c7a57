"""granularity="nested": what runs is compiled whole, each planned region marked as a
torch nested compile region (traced once, reused at every call).

Every model is checked against an independent eager copy (outputs, gradients, and
after training, parameters), because torch's reuse of a traced block across instances
is exactly where a wrong weight could slip in silently.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import CausalLM, data, gpt, gpt2, llama, trainer
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from models import Looped, LoopedBlock, SharedModel, registrations, tokens
from torch import nn

import lightning_regions.fabric as regional_fabric
from examples.fabric_gpt import train
from examples.tiny_gpt import GPTBlock, GPTConfig, TinyGPT
from lightning_regions import (
    PerInstanceRecompileWarning,
    RegionalCompileDDPStrategy,
    RegionalCompileFSDPStrategy,
    RegionalCompileStrategy,
    RegionNotCompiledWarning,
    TiedWeightsCheck,
    compat,
    compile_regions,
    find_regions,
    region_report,
    snapshot,
    warn_per_instance_recompiles,
)
from lightning_regions.core.nested import (
    NESTED_INDUCTOR_OPTIONS,
    NestedRegionError,
    is_marked,
    mark_nested,
)
from lightning_regions.core.regions import nest_plan

DEPTH = 12  # a real depth: reuse that fails per instance shows past torch's 8 entries


def tiny_gpt(**overrides) -> TinyGPT:
    config = {"n_layer": DEPTH, "n_embd": 16, "block_size": 16, **overrides}
    return TinyGPT(GPTConfig(**config))


def idx() -> torch.Tensor:
    return torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))


MODELS = {
    "gpt_alias_tied": (tiny_gpt, idx),
    "gpt_shared_blocks": (lambda: tiny_gpt(unique_blocks=3), idx),
    "gpt_checkpointing": (lambda: tiny_gpt(gradient_checkpointing=True), idx),
    "shared_descendant": (lambda: SharedModel(depth=6), tokens),
    "looped": (lambda: Looped(steps=6), lambda: torch.randn(3, 8)),
}


def assert_equal_to_eager(
    compiled: nn.Module, eager: nn.Module, x: torch.Tensor, kernels: float = 1.0
) -> None:
    """Outputs and gradients equal eager's; ``kernels`` widens the tolerances for
    inductor's own kernels (a different summation order, not a different result)."""
    out, expected = compiled(x), eager(x)
    torch.testing.assert_close(out, expected, rtol=1e-5 * kernels, atol=1e-6 * kernels)
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), eager.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4 * kernels, atol=1e-6 * kernels, msg=name
        )


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out_of_place"])
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_gradients_equal_eager_with_every_shared_structure_kept(name, inplace):
    build, inputs = MODELS[name]
    model = build()
    eager = copy.deepcopy(model)
    before, source = snapshot(model), registrations(model)
    keys = list(model.state_dict())
    compiled = compile_regions(model, inplace=inplace, granularity="nested", backend="aot_eager")
    assert_equal_to_eager(compiled, eager, inputs())

    after = snapshot(compiled)
    assert after.alias_groups == before.alias_groups and after.tie_groups == before.tie_groups
    assert after.none_paths == before.none_paths
    assert list(compiled.state_dict()) == keys  # the unit compiled whole keeps its keys
    report = region_report(compiled)
    assert [row.graphs for row in report.rows if not row.nested_in] == [1]
    assert report.nested and not report.never_ran_compiled
    called = [row for row in report.nested if row.nested_calls]
    # one block traced per class, every other call stamped out
    assert sum(row.nested_calls - row.nested_reuses for row in called) == 1
    for row in report.nested:
        marked = dict(compiled.named_modules(remove_duplicate=False))[row.paths[0]]
        assert is_marked(marked) and isinstance(marked, type(eager.get_submodule(row.paths[0])))
    if not inplace:  # the source is untouched: no marked class, no compiled call
        assert registrations(model) == source
        assert not any(is_marked(m) for m in model.modules())
        assert all(m._compiled_call_impl is None for m in model.modules())


class Holder(nn.Module):
    """A LightningModule's shape: a model, and blocks of its own at the top level."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt(n_layer=3)
        self.extra = nn.ModuleList([LoopedBlock(), LoopedBlock()])


def test_nest_plan_compiles_what_runs_whole_and_nests_the_regions_inside():
    holder = Holder()
    blocks = [f"model.blocks.{i}" for i in range(3)]
    loop_called = nest_plan(
        find_regions(holder, root_is_called=False), holder, root_is_called=False
    )
    # top-level blocks are what runs themselves: regions; the model is compiled whole
    assert [region.paths[0] for region in loop_called.regions] == ["extra.0", "extra.1", "model"]
    assert [region.paths[0] for region in loop_called.nested] == blocks
    assert loop_called.nested_in(loop_called.regions[2]) == loop_called.nested
    root_called = nest_plan(find_regions(holder), holder)
    assert [region.paths for region in root_called.regions] == [("",)]
    assert [region.paths[0] for region in root_called.nested] == [*blocks, "extra.0", "extra.1"]
    assert "GPTBlock, LoopedBlock nested inside" in root_called.regions[0].reason


def test_depth_12_gpt_is_one_graph_with_one_traced_block_reused_11_times():
    model = tiny_gpt()
    compiled = compile_regions(model, inplace=True, granularity="nested", backend="aot_eager")
    compiled(idx())
    report = region_report(compiled)
    assert report.graphs == 1
    rows = report.nested
    assert len(rows) == DEPTH and all(row.nested_in == "<root>" for row in rows)
    assert sum(row.nested_calls for row in rows) == DEPTH
    assert sum(row.nested_reuses for row in rows) == DEPTH - 1
    assert {row.nested_subgraphs for row in rows} == {1}
    assert "nested GPTBlock: 12 call(s) in graph, 1 traced, 11 reused" in str(report)
    assert type(model.blocks[0]).__name__ == "GPTBlock" and isinstance(model.blocks[0], GPTBlock)
    assert type(model.blocks[0]) is not GPTBlock  # marked: only the planned instances
    assert not is_marked(GPTBlock(GPTConfig()))  # the user's class is unchanged


def test_compiling_twice_marks_and_compiles_nothing_again():
    model = tiny_gpt(n_layer=4)
    compile_regions(model, inplace=True, granularity="nested", backend="aot_eager")
    marked, call = type(model.blocks[0]), model._compiled_call_impl
    compile_regions(model, inplace=True, granularity="nested", backend="aot_eager")
    assert type(model.blocks[0]) is marked and model._compiled_call_impl is call
    assert marked.__bases__ == (GPTBlock,)  # no marked class of a marked class


# --- torch's limits, loudly -------------------------------------------------------


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.proj(x)


class MutatesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.proj(x)


class ScaledPerLayer(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class IndexedStack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        for block in self.blocks:
            out = block(x)
            x = out[0] + out[1] if isinstance(out, tuple) else out
        return x


LIMITS = {
    "aliasing": (lambda i: ReturnsItsInput(), "returns one of its inputs", "input.clone()"),
    "mutation": (lambda i: MutatesItsInput(), "mutates one of its inputs", "out-of-place"),
    "reuse_limit": (lambda i: ScaledPerLayer(0.5 + i), "reuse limit", "register_buffer"),
}


@pytest.mark.parametrize("policy", ["raise", "eager"])
@pytest.mark.parametrize("limit", list(LIMITS))
def test_torchs_limits_raise_naming_the_regions_and_the_fix(limit, policy):
    make, what, fix = LIMITS[limit]
    model = IndexedStack([make(i) for i in range(DEPTH)])
    eager = copy.deepcopy(model)
    compile_regions(
        model,
        inplace=True,
        granularity="nested",
        backend="aot_eager",
        on_compile_error=policy,  # a unit holding nested regions has no eager fallback
    )
    x = torch.randn(2, 8, requires_grad=True)
    if limit == "reuse_limit" and not compat.NESTED_REUSE_LIMIT.applies:
        # torch < 2.12 has no reuse limit: it traces every instance apart, silently
        torch.testing.assert_close(model(x), eager(x))
        with pytest.warns(PerInstanceRecompileWarning, match=r"nested ScaledPerLayer: 12 of 12"):
            warn_per_instance_recompiles(region_report(model))
        assert "12 call(s) in graph, 12 traced, 0 reused" in str(region_report(model))
        return
    with pytest.raises(NestedRegionError) as raised:
        model(x).sum().backward()
    message = str(raised.value)
    assert f"{type(model.blocks[0]).__name__} at blocks.0" in message
    assert "and 9 more" in message and "inside IndexedStack at <root>" in message
    assert what in message and fix in message and "granularity='regions'" in message


def test_the_same_models_train_with_granularity_regions():
    """The fix the errors name: every limit above is fine as regions."""
    for make, _, _ in LIMITS.values():
        model = IndexedStack([make(i) for i in range(3)])
        eager = copy.deepcopy(model)
        compile_regions(model, inplace=True, backend="aot_eager")
        x = torch.randn(2, 8)
        torch.testing.assert_close(model(x.clone()), eager(x.clone()))


def test_unknown_granularity_and_torch_without_the_api_raise_before_compiling(monkeypatch):
    model = tiny_gpt(n_layer=2)
    with pytest.raises(
        ValueError, match=r"granularity='blocks': use one of \('regions', 'nested'\)"
    ):
        compile_regions(model, granularity="blocks")
    with pytest.raises(ValueError, match="granularity='layers'"):
        RegionalCompileStrategy(granularity="layers")
    # an older torch: the API is missing (torch < 2.8)
    monkeypatch.delattr(torch.compiler, "nested_compile_region")
    for build in (
        lambda: compile_regions(model, granularity="nested"),
        lambda: RegionalCompileStrategy(granularity="nested"),
        lambda: RegionalCompileDDPStrategy(granularity="nested"),
        lambda: regional_fabric.RegionalCompileStrategy(granularity="nested"),
    ):
        with pytest.raises(RuntimeError, match=r"needs torch\.compiler\.nested_compile_region"):
            build()
    assert model._compiled_call_impl is None and not any(is_marked(m) for m in model.modules())


def test_fsdp2_refuses_nested_in_the_constructor_with_what_was_measured():
    with pytest.raises(ValueError, match="not supported under FSDP2") as raised:
        RegionalCompileFSDPStrategy(granularity="nested")
    assert "granularity='regions'" in str(raised.value)


# --- under Lightning ---------------------------------------------------------------


def test_training_under_the_strategy_equals_plain_lightning_and_checkpoints_stay_plain(
    tmp_path,
):
    compiled, plain = gpt(n_layer=DEPTH, unique_blocks=None), gpt(n_layer=DEPTH, unique_blocks=None)
    plain.load_state_dict(compiled.state_dict())
    strategy = RegionalCompileStrategy(backend="aot_eager", granularity="nested")
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionNotCompiledWarning)
        trainer(tmp_path, strategy, callbacks=[TiedWeightsCheck(), saving]).fit(compiled, data())
    trainer(tmp_path / "plain", "auto").fit(plain, data())

    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5)
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    assert compiled._compiled_call_impl is None  # never the LightningModule root
    assert compiled.model._compiled_call_impl is not None
    assert compiled.model.lm_head.weight is compiled.model.wte.weight
    report = region_report(compiled)
    assert [row.paths for row in report.rows if not row.nested_in] == [("model",)]
    assert sum(row.nested_calls for row in report.nested) == DEPTH
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    fresh = gpt(n_layer=DEPTH, unique_blocks=None)
    fresh.load_state_dict(state, strict=True)  # the plain model's keys


def test_bf16_mixed_with_gradient_accumulation_equals_plain_lightning(tmp_path):
    ours, plain = gpt(n_layer=4, unique_blocks=None), gpt(n_layer=4, unique_blocks=None)
    plain.load_state_dict(ours.state_dict())
    strategy = RegionalCompileStrategy(backend="aot_eager", granularity="nested")
    options = {"precision": "bf16-mixed", "accumulate_grad_batches": 2}
    trainer(tmp_path, strategy, callbacks=[TiedWeightsCheck()], **options).fit(ours, data())
    trainer(tmp_path / "plain", "auto", **options).fit(plain, data())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert sum(row.nested_calls for row in region_report(ours).nested) == 4


def test_ema_equals_plain_lightnings_ema(tmp_path):
    ours, plain = gpt(n_layer=4, unique_blocks=None), gpt(n_layer=4, unique_blocks=None)
    plain.load_state_dict(ours.state_dict())
    strategy = RegionalCompileStrategy(backend="aot_eager", granularity="nested")
    trainer(tmp_path, strategy, 6, [TiedWeightsCheck(), EMAWeightAveraging(decay=0.5)]).fit(
        ours, data()
    )
    trainer(tmp_path / "plain", "auto", 6, [EMAWeightAveraging(decay=0.5)]).fit(plain, data())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    for (name, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)  # the averaged weights
    assert ours.model.lm_head.weight is ours.model.wte.weight
    assert sum(row.nested_calls for row in region_report(ours).nested) == 4


def test_resume_from_a_nested_checkpoint_gives_the_uninterrupted_losses(tmp_path):
    # One batch per epoch, as in test_lightning's resume test: Lightning 2.6 does not
    # replay a plain DataLoader's order after a resume, so the data is held fixed.
    def run(model, steps, root, **kwargs):
        checkpoint = ModelCheckpoint(dirpath=root, save_last=True)
        strategy = RegionalCompileStrategy(backend="aot_eager", granularity="nested")
        t = trainer(root, strategy, steps, [checkpoint], limit_train_batches=1)
        t.fit(model, data(), **kwargs)

    straight, first = gpt(n_layer=4, unique_blocks=None), gpt(n_layer=4, unique_blocks=None)
    run(straight, 6, tmp_path / "a")
    run(first, 3, tmp_path / "b")
    resumed = gpt(
        n_layer=4, unique_blocks=None, seed=123
    )  # a different init: everything must come from the checkpoint
    run(resumed, 6, tmp_path / "b", ckpt_path=tmp_path / "b" / "last.ckpt")
    assert first.losses + resumed.losses == pytest.approx(straight.losses, rel=1e-5)
    assert sum(row.nested_calls for row in region_report(resumed).nested) == 4


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_transformers_decoders_at_depth_12_nest_every_layer_and_train_as_plain(tmp_path, build):
    ours, plain = CausalLM(build), CausalLM(build)
    tokens_ = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens_, batch_size=4)
    strategy = RegionalCompileStrategy(backend="aot_eager", granularity="nested")
    torch.manual_seed(1)
    trainer(tmp_path, strategy, steps=2).fit(ours, loader)
    torch.manual_seed(1)
    trainer(tmp_path / "plain", "auto", steps=2).fit(plain, loader)
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    report = region_report(ours)
    assert len(report.nested) == 12 and not report.never_ran_compiled
    assert sum(row.nested_calls for row in report.nested) >= 12
    traced = sum(row.nested_calls - row.nested_reuses for row in report.nested)
    assert traced <= 2, str(report)  # one block per graph, not one per layer


def test_a_fabric_loop_with_nested_granularity_equals_plain_fabric():
    strategy = regional_fabric.RegionalCompileStrategy(backend="aot_eager", granularity="nested")
    model, losses = train(Fabric(accelerator="cpu", devices=1, strategy=strategy), steps=3)
    plain_model, plain_losses = train(Fabric(accelerator="cpu", devices=1), steps=3)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    module = model.module
    assert module._compiled_call_impl is not None and module.lm_head.weight is module.wte.weight
    assert region_report(module).nested and not region_report(module).never_ran_compiled
    for (name, p), (_, q) in zip(
        module.named_parameters(), plain_model.module.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.inductor
def test_inductor_nested_equals_eager():
    model = tiny_gpt()
    eager = copy.deepcopy(model)
    compiled = compile_regions(model, inplace=True, granularity="nested")
    assert_equal_to_eager(compiled, eager, idx(), kernels=10.0)
    assert "nested GPTBlock: 12 call(s) in graph, 1 traced, 11 reused" in str(region_report(model))


class TanhBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


#: The canary's width, and its batch x positions. Without the LayerNorm, torch's plan
#: writes the first Linear's weight gradient (width x width) over the blocks' input
#: gradient while that matmul still reads it, so the numbers are the BLAS's doing: at
#: width 8 this machine's MKL gets them wrong, and a BLAS that reads a small input whole
#: before writing gets them right (CI's machine of 2026-12-02, torch 2.11). At 1024 the
#: matmul's inner dimension spans more than one K block of the BLASes we know (256 to 512
#: floats), so part of the input is read after the output's first write on every one.
CANARY_WIDTH = 1024


class CanaryModel(nn.Module):
    """A Linear, 3 nested ``TanhBlock`` s, an optional LayerNorm and a Linear head: the
    shapes found to show torch's wrong nested-region gradients on each torch of CI
    (``compat.NESTED_BACKWARD_BUFFER_REUSE`` has the measurements)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        width = CANARY_WIDTH
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(TanhBlock(width) for _ in range(3))
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.out = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def nested_gradient_error(norm: bool, options: dict | None) -> float:
    """Largest gradient difference from eager of ``CanaryModel``, relative to the largest
    eager gradient of the same parameter, with its blocks marked as nested regions by hand
    and compiled whole by inductor with ``options``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CanaryModel(norm)
    eager = copy.deepcopy(model)
    for block in model.blocks:
        mark_nested(block)
    x = torch.randn(2, CANARY_WIDTH // 2, CANARY_WIDTH)
    torch.compile(model, options=options)(x).square().mean().backward()
    eager(x).square().mean().backward()
    return max(
        ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True)
    )


@pytest.mark.inductor
def test_torch_still_needs_buffer_reuse_off_for_nested_regions():
    """The canary for ``NESTED_INDUCTOR_OPTIONS``: torch's own nested regions under
    inductor's defaults give wrong gradients in at least one of two shapes on every torch
    of CI, and ours right ones in both. When this fails on the first assertion, torch
    has fixed it on this release: narrow ``compat.NESTED_BACKWARD_BUFFER_REUSE``."""
    assert compat.NESTED_BACKWARD_BUFFER_REUSE.applies and NESTED_INDUCTOR_OPTIONS
    torchs = {norm: nested_gradient_error(norm, None) for norm in (True, False)}
    ours = {norm: nested_gradient_error(norm, NESTED_INDUCTOR_OPTIONS) for norm in (True, False)}
    assert max(torchs.values()) > 1e-1, f"torch {torch.__version__} is right now: {torchs}"
    assert max(ours.values()) < 1e-5, ours
