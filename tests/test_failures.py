"""Loud failures: per-region compile errors, recompile storms, guarded cache artifacts."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import FailsOnLayerNorm
from models import SharedModel, Stack, tokens
from torch import nn

from lightning_regions import compile_regions, region_report
from lightning_regions.cache import (
    CacheArtifactsIgnoredWarning,
    artifact_guard,
    sign,
    unpack_artifacts,
)
from lightning_regions.core.tracking import RegionCompileError, RegionCompileWarning
from lightning_regions.core.watch import RecompileStormWarning


def block_failing_model() -> nn.Module:
    model = SharedModel(depth=2)
    model.extra = Stack(depth=2).layers  # a second block class the backend handles
    return model


@pytest.mark.parametrize("inplace", [False, True])
def test_raise_policy_raises_region_compile_error_naming_the_region(inplace):
    model = compile_regions(block_failing_model(), inplace=inplace, backend=FailsOnLayerNorm())
    with pytest.raises(RegionCompileError, match=r"Compiling region Block at blocks\.0") as info:
        model(tokens())
    # torch's BackendCompilerFailed is unwrapped: the backend's own error is the cause
    assert isinstance(info.value.__cause__, NotImplementedError)


@pytest.mark.parametrize("inplace", [False, True])
def test_eager_policy_falls_back_for_that_region_only(inplace):
    source = block_failing_model()
    eager = copy.deepcopy(source)
    model = compile_regions(
        source, inplace=inplace, on_compile_error="eager", backend=FailsOnLayerNorm()
    )
    with pytest.warns(RegionCompileWarning) as warned:
        out = model(tokens())
    torch.testing.assert_close(out, eager(tokens()))
    # one warning, naming every Block region: they all reuse the graph that failed
    (message,) = [str(w.message) for w in warned if w.category is RegionCompileWarning]
    assert "Region Block at blocks.0, blocks.2, blocks_alias.0, blocks_alias.2" in message
    assert "the 1 other Block region(s) that reuse its graph: blocks.1, blocks_alias.1" in message
    assert "NotImplementedError: no lowering for layer_norm" in message
    for layer in model.extra:
        layer(torch.randn(2, 8))
    report = region_report(model)
    failed = [row for row in report.rows if row.compile_error]
    assert [row.paths[0] for row in failed] == ["blocks.0", "blocks.1"]
    assert "EAGER (compile failed: NotImplementedError" in str(report)
    assert all(row.compiled_calls == 1 for row in report.rows if row.class_name == "Sequential")


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="on_compile_error='skip'"):
        compile_regions(Stack(), on_compile_error="skip", backend="eager")


def test_a_recompile_storm_is_counted_and_named(counting_backend):
    model = compile_regions(Stack(depth=3), inplace=True, backend="eager", dynamic=False)
    for length in range(2, 7):  # a new sequence length each step, dynamic shapes off
        model(torch.randn(length, 8, requires_grad=True))
    tracker = model.__dict__["_lightning_regions_tracker"]
    with pytest.warns(RecompileStormWarning, match=r"Sequential recompiled 4 times.*size"):
        stormy = tracker.watch.warn_storms(threshold=3)
    assert [entry.class_name for entry in stormy] == ["Sequential"]
    assert tracker.watch.warn_storms(threshold=3) == []  # warned once
    text = str(region_report(model))
    assert "recompiles of Sequential: 4" in text


def test_mismatched_artifacts_are_ignored_with_one_warning():
    guard = artifact_guard("cpu", {"backend": "inductor", "mode": "default"})
    old = dict(guard, torch="1.0.0")
    payload = {"guard": old, "artifacts": b"not loaded", "signature": sign(old, b"not loaded")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="torch: saved '1.0.0'") as record:
        assert unpack_artifacts(payload, guard) is False
    assert len(record) == 1
    other = artifact_guard("cuda", {"backend": "inductor", "mode": "max-autotune"})
    payload = {"guard": other, "artifacts": b"x", "signature": sign(other, b"x")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="device_type.*options"):
        assert unpack_artifacts(payload, guard) is False
    assert unpack_artifacts(None, guard) is False


def test_recompile_limit_hits_are_counted():
    model = compile_regions(Stack(depth=2), inplace=True, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):  # torch.compile's argument is >= 2.12
        for length in range(2, 6):
            model(torch.randn(length, 8, requires_grad=True))
    (entry,) = region_report(model).recompiles
    assert entry.limit_hits >= 1
    assert "recompile-limit hits" in str(region_report(model))
