"""``compile_regions(eager_hooks=True)``: each region's ``forward`` alone is compiled, so
the hooks registered on the region itself run eager around its compiled code (what
DeepSpeed's strategy needs; tests/test_deepspeed.py runs DeepSpeed itself)."""

from __future__ import annotations

import copy
import io
from types import MethodType

import pytest
import torch
from models import SharedModel, Stack, tokens
from torch import nn

from lightning_regions import compile_regions, region_report, snapshot


class HookLog:
    """Forward pre-hooks and hooks that record whether dynamo was tracing them."""

    def __init__(self) -> None:
        self.traced: list[bool] = []

    def pre(self, module: nn.Module, args: tuple) -> None:
        self.traced.append(torch.compiler.is_compiling())

    def post(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.traced.append(torch.compiler.is_compiling())


def hooked(model: nn.Module, blocks: nn.ModuleList) -> HookLog:
    log = HookLog()
    for block in dict.fromkeys(blocks):
        block.register_forward_pre_hook(log.pre)
        block.register_forward_hook(log.post)
    return log


@pytest.mark.parametrize("eager_hooks", [False, True])
def test_a_regions_own_hooks_run_eager_only_with_eager_hooks(eager_hooks):
    model = SharedModel()
    log = hooked(model, model.blocks)
    compile_regions(model, inplace=True, backend="eager", eager_hooks=eager_hooks)
    model(tokens())
    assert log.traced and set(log.traced) == {not eager_hooks}  # module.compile traces them


def test_outputs_gradients_keys_and_ties_equal_an_eager_copy():
    model = SharedModel()
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    compile_regions(model, inplace=True, backend="aot_eager", eager_hooks=True)
    for m in (model, eager):
        m(tokens()).square().mean().backward()
    got, want = snapshot(model).parameters, snapshot(eager).parameters
    for path in want:
        torch.testing.assert_close(got[path].grad, want[path].grad, msg=path)
    assert list(model.state_dict()) == keys and model.head.weight is model.embed.weight
    report = region_report(model)
    assert report.rows and not report.never_ran_compiled


@pytest.mark.parametrize("eager_hooks", [False, True])
def test_built_in_classes_compile_through_their_trampoline(eager_hooks):
    model = Stack(depth=4)  # nn.Sequential blocks: dynamo would skip torch.nn's forward
    eager = copy.deepcopy(model)
    compile_regions(model, inplace=True, backend="eager", eager_hooks=eager_hooks)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), eager(x))
    report = region_report(model)
    # the first block's input needs no grad, the others' do: two graphs either way
    assert sum(row.graphs for row in report.rows) == 2 and not report.never_ran_compiled


def test_compiling_twice_compiles_nothing_again():
    model = Stack(depth=3)
    compile_regions(model, inplace=True, backend="eager", eager_hooks=True)
    forwards = [vars(layer)["forward"] for layer in model.layers]
    compile_regions(model, inplace=True, backend="eager", eager_hooks=True)
    assert [vars(layer)["forward"] for layer in model.layers] == forwards


@pytest.mark.parametrize("observe_calls", [1, None], ids=["after", "while_observed"])
def test_saved_and_deep_copied_models_are_plain_ones_with_the_same_outputs(observe_calls):
    model = SharedModel()
    compile_regions(
        model, inplace=True, backend="eager", eager_hooks=True, observe_calls=observe_calls
    )
    x = tokens()
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    copied = copy.deepcopy(model)
    torch.testing.assert_close(loaded(x), expected)
    torch.testing.assert_close(copied(x), expected)
    for plain in (loaded, copied):  # as after torch's module.compile(): nothing compiled
        forwards = [vars(m).get("forward") for m in plain.blocks]
        assert all(
            f is None or (type(f) is MethodType and f.__self__ is m)
            for f, m in zip(forwards, plain.blocks, strict=True)
        )


@pytest.mark.parametrize(
    ("inplace", "granularity"),
    [(False, "regions"), (True, "nested")],
    ids=["out_of_place", "nested"],
)
def test_eager_hooks_is_in_place_regions_only(inplace, granularity):
    with pytest.raises(ValueError, match="eager_hooks=True"):
        compile_regions(
            Stack(), inplace=inplace, granularity=granularity, backend="eager", eager_hooks=True
        )
