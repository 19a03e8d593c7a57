"""``core/progress.py``: what a compile running now is, in words. The plan's distinct
compiles (one per region class) counted k of n in the order they begin, a second compile
of a class a recompile, a deferred backward known by its frame's compile id, code that
is no region named by its own name; torch's event names read as phases. Pure: real
plans, no compile (the status drawn while torch compiles: ``test_status.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_regions.core.progress import CompileProgress, RunningCompile, compile_phase
from lightning_regions.core.regions import find_regions


class Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)


class MLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu()


def progress() -> CompileProgress:
    model = nn.Module()
    model.blocks = nn.ModuleList([Attention(), MLP(), Attention(), MLP()])
    return CompileProgress(find_regions(model, ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]))


def test_first_compiles_count_k_of_n_and_a_second_is_a_recompile():
    compiles = progress()
    assert compiles.total == 2
    first = compiles.begin(Attention.forward.__code__, "0/0", "", now=10.0)
    assert (first.what, first.index, first.total, first.again) == ("Attention", 1, 2, False)
    assert first.headline() == "compiling Attention (1 of 2)"
    assert first.text(now=22.4, phase="inductor") == "compiling Attention (1 of 2): 12 s, inductor"
    assert first.still(now=70.0) == "still compiling Attention: 60 s, 1 of 2"
    second = compiles.begin(MLP.forward.__code__, "1/0", "", now=30.0)
    assert second.count == "2 of 2"
    again = compiles.begin(Attention.forward.__code__, "0/1", "", now=40.0)
    assert again.again and again.count == "" and again.text(41.0) == "recompiling Attention: 1 s"


def test_a_deferred_backward_is_named_by_its_frames_compile_id():
    compiles = progress()
    compiles.begin(MLP.forward.__code__, "3/0", "", now=0.0)
    backward = compiles.begin(None, "3/0", "backward", now=5.0)
    assert backward.name == "MLP's backward" and backward.count == "1 of 2"
    assert backward.headline() == "compiling MLP's backward (1 of 2)"
    unknown = compiles.begin(None, "9/0", "CUDA graphs", now=5.0)
    assert unknown.name == "a graph's CUDA graphs" and unknown.count == ""


def test_code_of_no_region_is_named_by_its_own_name_without_a_count():
    def training_step(x):
        return x

    running = progress().begin(training_step.__code__, "5/0", "", now=0.0)
    assert running.what.endswith("training_step") and running.count == ""
    assert running.headline().startswith("compiling ") and "(" not in running.headline()


def test_torchs_events_read_as_the_innermost_known_phase():
    assert compile_phase([]) == ""
    assert compile_phase(["dynamo", "entire_frame_compile", "bytecode_tracing"]) == "tracing"
    frame = ["dynamo", "entire_frame_compile", "compile_attempt_0", "backend_compile"]
    assert compile_phase(frame) == "backend"
    assert compile_phase([*frame, "create_aot_dispatcher_function"]) == "AOTAutograd"
    assert compile_phase([*frame, "inductor_compile", "compile_fx_inner"]) == "inductor"
    assert compile_phase([*frame, "compile_fx_inner", "async_compile.wait"]) == ("building kernels")
    assert compile_phase(["something_torch_adds_later"]) == ""
    assert RunningCompile("X", began=0.0).text(3.0) == "compiling X: 3 s"
