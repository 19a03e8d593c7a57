"""Which region compiled what, and ran it (``core/tracking.py``): calls attributed to
their region, the observation window and its end (nothing of ours left on the call
path), a second model observed again."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import assert_matches_eager
from models import WIDTH, Looped, ParameterlessBlocks, Stack

from lightning_regions import compile_regions, end_observation, region_report
from lightning_regions.core.tracking import OBSERVED_CALLS, ObservedRegion

BOTH = pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])


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
