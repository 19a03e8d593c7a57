"""Regions that run on real models: repeats in time, indexable containers, attribution
by call, and the end of observation (nothing of ours left on the call path)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from models import (
    WIDTH,
    Looped,
    LoopedBlock,
    ParameterlessBlocks,
    SingleBlockList,
    Stack,
)
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_regions import compile_regions, end_observation, find_regions, region_report
from lightning_regions.core.tracking import OBSERVED_CALLS, ObservedRegion

BOTH = pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])


def assert_matches_eager(model: nn.Module, compiled: nn.Module, x: torch.Tensor) -> None:
    """Outputs, input gradients and parameter gradients equal an eager copy's."""
    eager = copy.deepcopy(model)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = eager(x_eager), compiled(x_compiled)
    torch.testing.assert_close(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(x_compiled.grad, x_eager.grad)
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), eager.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@BOTH
@pytest.mark.parametrize("model_class", [Looped, SingleBlockList], ids=["looped", "single_list"])
def test_a_block_repeated_in_time_is_one_region_with_one_graph(inplace, model_class):
    model = model_class()
    plan = find_regions(model)
    assert [type(region.module) for region in plan.regions] == [LoopedBlock]
    assert not plan.whole_model
    compiled = compile_regions(model, inplace=inplace, backend="aot_eager")
    assert_matches_eager(model, compiled, torch.randn(2, WIDTH))
    (row,) = region_report(compiled).rows
    assert row.graphs == 1
    assert row.compiled_calls == model.steps  # one forward: every loop iteration compiled


def test_the_plan_says_why_a_block_repeated_in_time_was_chosen():
    (looped,) = find_regions(Looped()).regions
    assert looped.reason == "LoopedBlock called in a loop in Looped.forward"
    (listed,) = find_regions(SingleBlockList()).regions
    assert listed.reason == "one LoopedBlock in ModuleList 'groups', run repeatedly"


def test_a_block_called_once_is_not_a_repeat_in_time():
    class CalledOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = LoopedBlock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = torch.tanh(x)  # a loop, but the block is outside it
            return self.block(x)

    with pytest.warns(UserWarning, match="no repeated blocks"):
        assert find_regions(CalledOnce()).whole_model


def test_albert_default_shares_one_layer_group_compiled_once():
    transformers = pytest.importorskip("transformers")
    config = transformers.AlbertConfig(
        vocab_size=50,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
    )  # num_hidden_groups=1, inner_group_num=1: ALBERT's default layer sharing
    model = transformers.AlbertForMaskedLM(config).eval()
    ids = torch.randint(0, 50, (2, 8))
    expected = model(input_ids=ids).logits
    compiled = compile_regions(copy.deepcopy(model), inplace=True, backend="aot_eager")
    actual = compiled(input_ids=ids).logits
    torch.testing.assert_close(actual, expected)
    (row,) = region_report(compiled).rows
    assert row.class_name == "AlbertLayerGroup"
    assert (row.graphs, row.compiled_calls) == (1, 4)
    actual.sum().backward()
    expected.sum().backward()
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-4, atol=1e-6)


def test_an_out_of_place_container_region_keeps_indexing_len_and_iteration():
    inner = nn.Sequential(nn.Linear(WIDTH, WIDTH))
    source = nn.ModuleList([inner, nn.Sequential(inner[0])])
    result = compile_regions(source, backend="eager")
    region = result[0]
    assert isinstance(region, OptimizedModule)  # accelerate still unwraps it
    assert region[0] is inner[0]
    assert len(region) == 1
    assert list(region) == [inner[0]]
    assert inner[0] in region
    x = torch.randn(2, WIDTH)
    torch.testing.assert_close(region(x), inner(x))


def test_a_non_container_region_does_not_pretend_to_be_one():
    result = compile_regions(Looped(), backend="eager")
    assert type(result.block) is OptimizedModule
    with pytest.raises(TypeError, match="not subscriptable"):
        result.block[0]


@BOTH
def test_calls_are_attributed_after_load_state_dict_with_assign(inplace):
    model = Stack(depth=3)
    compiled = compile_regions(model, inplace=inplace, backend="aot_eager")
    before = compiled.layers[0][0].weight
    fresh = {key: value.clone() for key, value in compiled.state_dict().items()}
    compiled.load_state_dict(fresh, assign=True)  # new Parameter objects in every block
    assert compiled.layers[0][0].weight is not before
    compiled(torch.randn(2, WIDTH, requires_grad=True))
    report = region_report(compiled)
    assert [row.compiled_calls for row in report.rows] == [1, 1, 1]
    assert report.rows[0].graphs == 1


@BOTH
def test_a_parameterless_region_is_attributed(inplace):
    model = ParameterlessBlocks()
    compiled = compile_regions(model, inplace=inplace, backend="aot_eager")
    assert_matches_eager(model, compiled, torch.randn(2, WIDTH))
    report = region_report(compiled)
    assert [row.class_name for row in report.rows] == ["Sine", "Sine"]
    assert [row.compiled_calls for row in report.rows] == [1, 1]
    assert "untracked" not in str(report)


def files_on_the_call_path(call) -> set[str]:
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def ours(files: set[str]) -> set[str]:
    return {f for f in files if "lightning_regions" in f}


@BOTH
def test_after_the_window_nothing_of_ours_is_on_the_region_call_path(inplace):
    model = Looped(steps=2)
    compiled = compile_regions(model, inplace=inplace, backend="aot_eager")
    x = torch.randn(2, WIDTH, requires_grad=True)
    assert ours(files_on_the_call_path(lambda: compiled(x)))  # observed: our wrappers run
    calls_per_forward = 2
    for _ in range(OBSERVED_CALLS // calls_per_forward):
        compiled(x).sum().backward()
    (row,) = region_report(compiled).rows
    assert row.observed_calls == OBSERVED_CALLS  # the window ended; counts stop there
    assert ours(files_on_the_call_path(lambda: compiled(x).sum().backward())) == set()
    if inplace:
        assert not isinstance(compiled.block._compiled_call_impl, ObservedRegion)
    assert region_report(compiled).rows[0].observed_calls == OBSERVED_CALLS


def test_an_open_ended_window_lasts_until_end_observation():
    compiled = compile_regions(Looped(steps=2), inplace=True, backend="eager", observe_calls=None)
    x = torch.randn(2, WIDTH)
    for _ in range(OBSERVED_CALLS):
        compiled(x)
    assert region_report(compiled).rows[0].observed_calls == 2 * OBSERVED_CALLS
    end_observation(compiled)
    assert ours(files_on_the_call_path(lambda: compiled(x))) == set()
    compiled(x)
    assert region_report(compiled).rows[0].observed_calls == 2 * OBSERVED_CALLS


def test_a_second_model_after_the_first_window_is_observed_again():
    x = torch.randn(2, WIDTH)
    first = compile_regions(Looped(steps=2), inplace=True, backend="aot_eager", observe_calls=2)
    first(x)
    second = compile_regions(Looped(steps=2), inplace=True, backend="aot_eager", observe_calls=2)
    second(x)  # reuses the first model's graph, which was taken off the path
    assert region_report(second).rows[0].compiled_calls == 2
    assert ours(files_on_the_call_path(lambda: (first(x), second(x)))) == set()


def test_observe_calls_must_be_positive():
    with pytest.raises(ValueError, match="observe_calls=0"):
        compile_regions(Looped(), backend="eager", observe_calls=0)
