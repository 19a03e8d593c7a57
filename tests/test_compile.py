"""compile_regions on models with aliases, shared blocks, None children and ties."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.utils import extract_model_from_parallel
from models import Flat, SharedModel, Stack, registrations, tokens
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_regions import (
    NoRepeatedBlocksWarning,
    compile_regions,
    region_report,
    snapshot,
)

MODES = [pytest.param(False, id="out_of_place"), pytest.param(True, id="in_place")]


def grads_by_path(model: nn.Module) -> dict[str, torch.Tensor]:
    return {path: p.grad for path, p in snapshot(model).parameters.items()}


@pytest.mark.parametrize("inplace", MODES)
def test_alias_repro_gives_the_eager_output(inplace):
    model = SharedModel()
    eager = copy.deepcopy(model)
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    torch.testing.assert_close(compiled(tokens()), eager(tokens()))


@pytest.mark.parametrize("inplace", MODES)
def test_outputs_and_parameter_grads_match_an_eager_copy(inplace):
    model = SharedModel()
    eager = copy.deepcopy(model)
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    for m in (compiled, eager):
        m(tokens()).square().mean().backward()
    got, want = grads_by_path(compiled), grads_by_path(eager)
    assert got.keys() == want.keys()
    for path in want:
        torch.testing.assert_close(got[path], want[path], msg=path)


@pytest.mark.parametrize("inplace", MODES)
def test_input_gradients_match_an_eager_copy(inplace):
    model = Stack(depth=3)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    compile_regions(model, inplace=inplace, backend="eager")(x).sum().backward()
    eager(x_eager).sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad)


@pytest.mark.parametrize("inplace", MODES)
def test_every_path_and_alias_survives(inplace):
    model = SharedModel()
    before = snapshot(model)
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    after = snapshot(compiled)
    assert after.modules.keys() == before.modules.keys()
    assert after.alias_groups == before.alias_groups
    for group in before.alias_groups:
        resolved = {id(compiled.get_submodule(path)) for path in group}
        assert len(resolved) == 1, group
    assert compiled.blocks_alias is compiled.blocks
    assert compiled.blocks[0] is compiled.blocks[-1]
    assert compiled.dropped is None and "dropped" in compiled._modules
    assert after.none_paths == before.none_paths
    assert "blocks.1.unused" in after.none_paths


@pytest.mark.parametrize("inplace", MODES)
def test_shared_descendant_is_one_object_inside_and_outside_regions(inplace):
    model = SharedModel()
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    inside = {id(compiled.get_submodule(f"blocks.{i}.positional")) for i in range(4)}
    assert inside == {id(compiled.positional)} == {id(model.positional)}


@pytest.mark.parametrize("inplace", MODES)
def test_parameters_are_the_source_objects_so_ties_hold(inplace):
    model = SharedModel()
    source_params = snapshot(model).parameters
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    for path, param in snapshot(compiled).parameters.items():
        assert param is source_params[path], path
    assert compiled.head.weight is compiled.embed.weight
    assert len(list(compiled.parameters())) == len(list(model.parameters()))


def test_out_of_place_leaves_the_source_unchanged():
    model = SharedModel()
    before = registrations(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = compile_regions(model, backend="eager")
    compiled(tokens()).sum().backward()
    assert registrations(model) == before
    assert not any(isinstance(m, OptimizedModule) for m in model.modules())
    assert all(m._compiled_call_impl is None for m in model.modules())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key])


def test_out_of_place_keeps_accelerates_return_shape():
    model = SharedModel()
    compiled = compile_regions(model, backend="eager")
    assert compiled is not model
    assert compiled.__dict__["_orig_mod"] is model
    assert isinstance(compiled.blocks[1], OptimizedModule)
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


@pytest.mark.parametrize("inplace", MODES)
def test_containers_stay_containers(inplace):
    model = SharedModel()
    compiled = compile_regions(model, inplace=inplace, backend="eager")
    assert type(compiled.blocks) is nn.ModuleList
    assert type(compiled.classifier) is nn.ModuleList
    assert [type(m) for m in compiled.classifier] == [nn.Linear, nn.GELU]
    assert compiled.classifier[0] is model.classifier[0]


def test_in_place_keeps_identity_types_hooks_and_keys():
    model = SharedModel()
    keys = list(model.state_dict())
    types = {id(m): type(m) for m in model.modules()}
    calls = []
    model.blocks[1].register_forward_hook(lambda *_: calls.append("hook"))
    compiled = compile_regions(model, inplace=True, backend="eager")
    assert compiled is model
    assert list(model.state_dict()) == keys
    assert {id(m): type(m) for m in model.modules()} == types
    model(tokens())
    assert calls == ["hook"]
    fresh = SharedModel()
    fresh.load_state_dict(model.state_dict(), strict=True)


def test_in_place_twice_compiles_nothing_twice():
    model = SharedModel()
    compile_regions(model, inplace=True, backend="eager")
    first = {id(m): m._compiled_call_impl for m in model.modules()}
    report = region_report(model)
    assert compile_regions(model, inplace=True, backend="eager") is model
    assert {id(m): m._compiled_call_impl for m in model.modules()} == first
    assert region_report(model) == report
    assert not any(isinstance(m, OptimizedModule) for m in model.modules())


def test_out_of_place_on_a_result_wraps_no_wrapper():
    model = SharedModel()
    once = compile_regions(model, backend="eager")
    twice = compile_regions(once, backend="eager")
    wrappers = [m for m in twice.modules() if isinstance(m, OptimizedModule)]
    assert wrappers and not any(isinstance(w._orig_mod, OptimizedModule) for w in wrappers)
    assert twice.blocks[1] is once.blocks[1]
    torch.testing.assert_close(twice(tokens()), model(tokens()))


@pytest.mark.parametrize("inplace", MODES)
def test_twelve_identical_blocks_give_one_graph(inplace, counting_backend):
    model = Stack(depth=12)
    compiled = compile_regions(model, inplace=inplace, backend=counting_backend)
    compiled(torch.randn(2, 8, requires_grad=True))
    report = region_report(compiled)
    assert len(counting_backend.graphs) == 1
    assert report.graphs == 1 and len(report.rows) == 12
    assert [row.compiled_calls for row in report.rows] == [1] * 12


@pytest.mark.parametrize("inplace", MODES)
def test_every_distinct_region_produces_graphs(inplace, counting_backend):
    model = SharedModel()
    compiled = compile_regions(model, inplace=inplace, backend=counting_backend)
    compiled(tokens())
    report = region_report(compiled)
    assert sum(row.graphs for row in report.rows) == len(counting_backend.graphs) >= 1
    assert all(row.compiled_calls >= 1 for row in report.rows)
    assert report.rows[0].compiled_calls == 2  # blocks[0] also runs as blocks[-1]
    assert not report.never_ran_compiled


@pytest.mark.parametrize("inplace", MODES)
def test_no_repeated_blocks_warns_and_compiles_the_whole_model(inplace, counting_backend):
    model = Flat()
    eager = copy.deepcopy(model)
    with pytest.warns(NoRepeatedBlocksWarning, match="whole model"):
        compiled = compile_regions(model, inplace=inplace, backend=counting_backend)
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), eager(x))
    report = region_report(compiled)
    assert report.whole_model and report.rows[0].compiled_calls == 1
    assert len(counting_backend.graphs) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "no_such_backend"}, "Unknown torch.compile backend 'no_such_backend'"),
        ({"mode": "fastest"}, "Unknown torch.compile mode 'fastest'"),
        ({"backend": "eager", "mode": "max-autotune"}, "applies to backend='inductor' only"),
        ({"mode": "default", "options": {}}, "either mode= or options="),
    ],
)
def test_bad_compile_arguments_raise_before_anything_is_compiled(kwargs, message):
    model = SharedModel()
    with pytest.raises(ValueError, match=message):
        compile_regions(model, inplace=True, **kwargs)
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_torch_builtin_blocks_really_compile_in_place(counting_backend):
    """nn.Module.compile() alone runs a torch.nn class eager; ours must not."""
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False).eval()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 2, 8)
    compile_regions(model, inplace=True, backend=counting_backend)
    with torch.no_grad():  # one requires_grad state for every layer's input
        torch.testing.assert_close(model(x), eager(x))
    report = region_report(model)
    assert [row.compiled_calls >= 1 for row in report.rows] == [True] * 3
    # One layer's graphs (torch's layer forward has a graph break), reused by all three.
    assert report.rows[0].graphs >= 1 and len(counting_backend.graphs) <= 2
    assert report.rows[1].graphs == report.rows[2].graphs == 0
