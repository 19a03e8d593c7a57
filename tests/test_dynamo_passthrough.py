"""Never fail where ``torch.compile`` works: dynamo's own control flow passes through the
tracking backend, and only real backend failures are a region's compile failure."""

from __future__ import annotations

import copy
import inspect
import re

import lightning.pytorch as pl
import pytest
import torch
from models import (
    WIDTH,
    Flat,
    Looped,
    LoopedBlock,
    ParameterlessBlocks,
    ScaledStack,
    SharedModel,
    SingleBlockList,
    Stack,
    tokens,
)
from torch import nn
from torch._dynamo import exc as dynamo_exc
from torch._dynamo.output_graph import OutputGraph
from torch._subclasses import fake_tensor

from lightning_regions import (
    PerInstanceRecompileWarning,
    RegionalCompileStrategy,
    compile_regions,
    region_report,
)
from lightning_regions.core.tracking import (
    DYNAMO_GRAPH_BREAKS,
    DYNAMO_RERAISES,
    PASSED_TO_DYNAMO,
    RegionCompileError,
)


def test_the_reraised_group_is_the_one_torch_reraises():
    """Pins torch's own lists: an upgrade that changes them fails here first."""
    source = inspect.getsource(OutputGraph._call_user_compiler)
    reraised = set()
    for names, body in re.findall(r"except \(?([\w., \n]+?)\)?(?: as \w+)?:\n(.*?)\n", source):
        if body.strip() == "raise" or body.strip().startswith("#"):
            reraised |= {name.strip() for name in names.split(",") if name.strip()}
    assert reraised == {cls.__name__ for cls in DYNAMO_RERAISES}
    assert "except exceptions_allowed_to_be_fallback" in source
    assert DYNAMO_GRAPH_BREAKS == tuple(dynamo_exc.exceptions_allowed_to_be_fallback)


OP = torch.ops.aten.add.Tensor
EXCEPTIONS = {
    "TensorifyScalarRestartAnalysis": lambda: dynamo_exc.TensorifyScalarRestartAnalysis(),
    "ShortenTraceback": lambda: dynamo_exc.ShortenTraceback("short", first_useful_frame=None),
    "IndexError": lambda: IndexError("dim out of range"),
    "SkipFrame": lambda: dynamo_exc.SkipFrame("skip me"),
    "DataDependentOutputException": lambda: fake_tensor.DataDependentOutputException(OP),
    "DynamicOutputShapeException": lambda: fake_tensor.DynamicOutputShapeException(OP),
    "UnsupportedOperatorException": lambda: fake_tensor.UnsupportedOperatorException(OP),
    "UnsupportedFakeTensorException": lambda: fake_tensor.UnsupportedFakeTensorException("x"),
    "UnsupportedMutationAliasingException": lambda: (
        fake_tensor.UnsupportedMutationAliasingException("x")
    ),
    "RuntimeError": lambda: RuntimeError("a real backend failure"),
}


class RaisesOnce:
    """A backend whose first graph raises ``error``; later graphs run eagerly."""

    def __init__(self, make_error) -> None:
        self.make_error = make_error
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        if self.calls == 1:
            raise self.make_error()
        return gm.forward


def outcome(call) -> tuple[str, torch.Tensor | None]:
    """What a call ended in: ``ok`` and the output, or the exception class names."""
    try:
        return "ok", call()
    except Exception as error:
        names, cause = [], error
        while cause is not None:
            names.append(type(cause).__name__)
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        return " <- ".join(names), None


def test_that_covers_every_group():
    assert set(EXCEPTIONS) >= {cls.__name__ for cls in DYNAMO_RERAISES + DYNAMO_GRAPH_BREAKS}


@pytest.mark.parametrize("name", list(EXCEPTIONS))
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])
def test_a_backend_exception_ends_as_it_does_under_plain_torch_compile(name, inplace):
    block = LoopedBlock()
    x = torch.randn(2, WIDTH)
    expected = block(x)
    plain_kind, plain_out = outcome(
        lambda: torch.compile(copy.deepcopy(block), backend=RaisesOnce(EXCEPTIONS[name]))(x)
    )
    torch._dynamo.reset()
    blocks = nn.ModuleList([block, copy.deepcopy(block)])
    compiled = compile_regions(blocks, inplace=inplace, backend=RaisesOnce(EXCEPTIONS[name]))
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    our_kind, our_out = outcome(lambda: compiled[0](x))
    if name not in {cls.__name__ for cls in PASSED_TO_DYNAMO}:
        # a real failure on this torch (IndexError is one before 2.13): torch wraps it;
        # the user gets ours, naming the region, with the backend's error as its cause
        assert plain_kind == f"BackendCompilerFailed <- {name}"
        assert our_kind == f"RegionCompileError <- {name}"
        return
    assert our_kind == plain_kind
    if plain_out is not None:
        torch.testing.assert_close(our_out, expected)
        torch.testing.assert_close(plain_out, expected)
    report = region_report(compiled)
    assert all(row.compile_error is None for row in report.rows)
    if name in {cls.__name__ for cls in DYNAMO_GRAPH_BREAKS}:
        assert report.graph_breaks > breaks_before  # a graph break, not a failed region


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("policy", ["raise", "eager"])
def test_dynamos_restart_from_inside_the_backend_is_not_a_compile_failure(inplace, policy):
    model = ScaledStack()
    eager = copy.deepcopy(model)
    compiled = compile_regions(model, inplace=inplace, backend="aot_eager", on_compile_error=policy)
    x = torch.randn(2, WIDTH, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out, expected = compiled(x), eager(x_eager)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    report = region_report(compiled)
    assert all(row.compile_error is None and row.compiled_calls == 1 for row in report.rows)


class ScaledModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ScaledStack()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
def test_the_restart_reproducer_trains_under_the_strategy(tmp_path, backend):
    from helpers import trainer

    loader = torch.utils.data.DataLoader([(torch.randn(WIDTH),) for _ in range(16)], 4)
    compiled, plain = ScaledModule(), ScaledModule()
    with pytest.warns(PerInstanceRecompileWarning, match="ScaledBlock: 3 graph"):
        trainer(tmp_path, RegionalCompileStrategy(backend=backend), 4).fit(compiled, loader)
    trainer(tmp_path, "auto", 4).fit(plain, loader)
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5)
    report = region_report(compiled)
    assert not report.never_ran_compiled
    # the restart specialises each block's own scale: named, with the float's fix
    (entry,) = report.per_instance
    assert entry.guards[0].expression.startswith("self.scale == ")
    assert "could not keep it symbolic" in entry.fix


def swin():
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        embed_dim=8,
        depths=[1, 1, 1],
        num_heads=[1, 1, 1],
        window_size=2,
        num_labels=3,
        drop_path_rate=0.2,  # a float per block: the restart Swin users hit
    )
    return transformers.SwinForImageClassification(config).eval(), torch.randn(2, 3, 16, 16)


@pytest.mark.slow  # about 105 s a mode on 2 CPU cores: make test-slow
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])
def test_swin_compiles_regionally_through_the_restart_and_matches_eager(inplace):
    model, pixels = swin()
    compiled = compile_regions(copy.deepcopy(model).train(), inplace=inplace, backend="aot_eager")
    eager = copy.deepcopy(model).train()
    torch.manual_seed(1)  # drop_path draws random numbers: the same ones in both
    actual = compiled(pixels).logits
    torch.manual_seed(1)
    torch.testing.assert_close(actual, eager(pixels).logits)
    report = region_report(compiled)
    assert all(row.compile_error is None and row.compiled_calls for row in report.rows)


def region_inputs(model: nn.Module, regions, call) -> dict[int, tuple]:
    """The arguments each region received in one eager call of ``model``."""
    seen: dict[int, tuple] = {}
    handles = [
        region.module.register_forward_pre_hook(
            lambda module, args, kwargs: seen.setdefault(id(module), (args, kwargs)),
            with_kwargs=True,
        )
        for region in regions
    ]
    try:
        call(model)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def features() -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(0))


def tiny_gpt() -> nn.Module:
    from examples.tiny_gpt import GPTConfig, TinyGPT

    return TinyGPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_embd=16, unique_blocks=2))


SUITE_MODELS = {
    "gpt": (tiny_gpt, lambda m: m(tokens())),
    "shared": (SharedModel, lambda m: m(tokens())),
    "stack": (Stack, lambda m: m(features().requires_grad_())),
    "flat": (Flat, lambda m: m(features())),
    "looped": (Looped, lambda m: m(features())),
    "single_list": (SingleBlockList, lambda m: m(features())),
    "parameterless": (ParameterlessBlocks, lambda m: m(features())),
    "scaled": (ScaledStack, lambda m: m(features())),
}


def differential(make_model, call, backend: str) -> None:
    """Where ``torch.compile`` of each region alone works, ``compile_regions`` works."""
    from lightning_regions import find_regions

    torch.manual_seed(0)
    model = make_model()
    plan = find_regions(model)
    inputs = region_inputs(model, plan.regions, call)
    for region in plan.regions:
        if id(region.module) in inputs:
            args, kwargs = inputs[id(region.module)]
            torch.compile(copy.deepcopy(region.module), backend=backend)(*args, **kwargs)
            torch._dynamo.reset()
    expected = call(model)
    for inplace in (False, True):
        compiled = compile_regions(copy.deepcopy(model), inplace=inplace, backend=backend)
        torch.testing.assert_close(call(compiled), expected, rtol=1e-4, atol=1e-5)
        assert not region_report(compiled).never_ran_compiled
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(SUITE_MODELS))
def test_compile_regions_works_wherever_torch_compile_of_each_region_works(name):
    differential(*SUITE_MODELS[name], backend="aot_eager")


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["stack", "scaled"])
def test_the_differential_guarantee_under_inductor(name):
    differential(*SUITE_MODELS[name], backend="inductor")


def test_a_real_failure_still_names_the_region():
    def fails(gm, example_inputs):
        raise RuntimeError("no kernel for this")

    compiled = compile_regions(Stack(depth=2), inplace=True, backend=fails)
    with pytest.raises(
        RegionCompileError, match=r"Compiling region Sequential at layers\.0"
    ) as info:
        compiled(torch.randn(2, WIDTH))
    assert isinstance(info.value.__cause__, RuntimeError)
