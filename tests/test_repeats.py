"""Regions that run on real models: repeats in time, indexable containers, attribution
by call, and the end of observation (nothing of ours left on the call path)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_matches_eager
from models import (
    WIDTH,
    Looped,
    LoopedBlock,
    SingleBlockList,
)
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_regions import compile_regions, find_regions, region_report

BOTH = pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])


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
