"""The checks that need a CUDA GPU (``-m cuda``): collected everywhere, skipped without one.

On a lent GPU machine: ``PYTHONPATH=. python3 -m pytest -m cuda tests/test_cuda.py``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from examples.tiny_gpt import GPTBlock, GPTConfig, TinyGPT
from lightning_regions import (
    RegionalCompileDeepSpeedStrategy,
    RegionalCompileFSDP1Strategy,
    RegionalCompileStrategy,
    TiedWeightsCheck,
    compile_regions,
    region_report,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCRIPT = Path(__file__).parent.parent / "examples" / "resume_run.py"


def test_inductor_regions_on_cuda_match_eager_outputs_and_gradients():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=64, n_head=2)).cuda()
    eager = copy.deepcopy(model)
    compile_regions(model, inplace=True, backend="inductor")
    idx = torch.randint(0, 65, (4, 64), device="cuda")
    out, expected = model(idx), eager(idx)
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
    out.float().pow(2).mean().backward()
    expected.float().pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-4, msg=name)
    assert not region_report(model).never_ran_compiled


class DevicesDuringTraining(pl.Callback):
    """Where the parameters are while training runs (teardown moves them back to the CPU)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.devices |= {p.device.type for p in pl_module.parameters()}


def fit_on_gpu(tmp_path, strategy, **kwargs):
    from helpers import data, gpt, trainer

    model, check, devices = gpt(), TiedWeightsCheck(), DevicesDuringTraining()
    trainer(tmp_path, strategy, 4, [check, devices], accelerator="gpu", **kwargs).fit(model, data())
    return model, check, devices.devices


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_the_strategy_trains_on_a_gpu_with_the_tie_check(tmp_path, mode):
    model, check, devices = fit_on_gpu(tmp_path, RegionalCompileStrategy(mode=mode))
    plain, _, _ = fit_on_gpu(tmp_path, "auto")
    assert model.losses == pytest.approx(plain.losses, rel=1e-3)
    assert check.broken == []
    assert model.model.lm_head.weight is model.model.wte.weight
    assert not region_report(model).never_ran_compiled
    assert devices == {"cuda"}  # every parameter on the GPU in every training step


def test_the_gate_picks_cuda_graphs_on_the_launch_bound_tiny_gpt(tmp_path, caplog):
    """4 blocks of width 256 and a batch of 4: the host's launches bound the step, which
    CUDA graphs replay in one (measured on an H200: 6.3 ms against 11.5 ms)."""
    from helpers import data, gpt, trainer

    from lightning_regions.gate.gate import (
        CANDIDATE_SETTLE,
        CUDA_GRAPHS,
        MAX_WINDOWS,
        SETTLE,
        WINDOW,
    )

    timed = 2 * WINDOW * MAX_WINDOWS  # each phase's steps where its turns disagree
    steps = 1 + SETTLE + timed + CANDIDATE_SETTLE + timed + 4
    size = {"n_layer": 4, "n_embd": 256, "n_head": 4}
    model, plain, check = gpt(**size), gpt(**size), TiedWeightsCheck()
    strategy = RegionalCompileStrategy()
    with caplog.at_level("INFO"):
        trainer(tmp_path, strategy, steps, [check], accelerator="gpu").fit(model, data())
    trainer(tmp_path, "auto", steps, accelerator="gpu").fit(plain, data())
    decision = strategy.payoff.decision
    assert decision is not None and decision.chosen == CUDA_GRAPHS, decision
    (graphs,) = decision.candidates
    assert graphs.counts and graphs.ms <= 0.6 * decision.compiled_ms, decision
    assert "MiB reserved" in graphs.note and str(decision) in caplog.text
    assert model.losses == pytest.approx(plain.losses, rel=1e-3)
    assert check.broken == [] and model.model.lm_head.weight is model.model.wte.weight


def resume_run(tmp_path: Path, run: str, cache: str, steps: int, ckpt: Path | None) -> dict:
    command = [sys.executable, str(SCRIPT), "--run-dir", str(tmp_path / run), "--accelerator"]
    command += ["gpu", "--cache-dir", str(tmp_path / cache), "--steps", str(steps)]
    command += ["--ckpt", str(ckpt)] if ckpt else []
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_start_on_a_gpu_from_checkpoint_artifacts(tmp_path):
    cold = resume_run(tmp_path, "a", "cache", 2, None)
    warm = resume_run(tmp_path, "b", "empty", 3, tmp_path / "a" / "last.ckpt")
    assert cold["fxgraph_miss"] > 0 and cold["fxgraph_hit"] == 0
    assert warm["fxgraph_hit"] > 0 and warm["fxgraph_miss"] == 0


# --- FSDP1 and DeepSpeed: GPU-only in Lightning ------------------------------------------

#: FSDP1 wraps a module registered at two positions once, at the first (torch's
#: ``named_children`` skips the repeat), and the other position then runs it outside its
#: wrapper: so these models give each position its own block, under plain Lightning too.
DISTINCT = {"unique_blocks": None}


def fit_wrapped(tmp_path, strategy, steps=4):
    from helpers import data, gpt, trainer

    model, check = gpt(**DISTINCT), TiedWeightsCheck()
    fitted = trainer(tmp_path, strategy, steps, [check], accelerator="gpu")
    fitted.fit(model, data())
    return model, check, fitted


def test_fsdp1_compiles_each_block_before_wrapping_and_equals_plain_fsdp(tmp_path):
    from lightning.pytorch.strategies import FSDPStrategy

    ours = RegionalCompileFSDP1Strategy(auto_wrap_policy={GPTBlock})
    model, check, fitted = fit_wrapped(tmp_path / "ours", ours)
    plain, _, _ = fit_wrapped(tmp_path / "plain", FSDPStrategy(auto_wrap_policy={GPTBlock}))
    assert model.losses == pytest.approx(plain.losses, rel=1e-3)
    assert check.broken == []  # the tied head is one Parameter after the first step
    report = region_report(model)
    assert report.rows and not report.never_ran_compiled
    assert sum(row.graphs for row in report.rows) == 1  # one graph for the block class
    keys = set(fitted.strategy.lightning_module_state_dict())
    assert keys == set(plain.state_dict())  # no _orig_mod., no FSDP prefix


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_compiles_each_block_before_initialize_and_equals_plain(tmp_path, stage):
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from torch._dynamo.utils import get_compilation_metrics

    model, check, _ = fit_wrapped(tmp_path / "ours", RegionalCompileDeepSpeedStrategy(stage=stage))
    frames = [m.co_filename or "" for m in get_compilation_metrics()]
    plain, _, _ = fit_wrapped(tmp_path / "plain", DeepSpeedStrategy(stage=stage))
    assert model.losses == pytest.approx(plain.losses, rel=1e-3)
    assert check.broken == []
    report = region_report(model)
    assert report.rows and not report.never_ran_compiled
    assert sum(row.graphs for row in report.rows) == 1
    assert model.model.lm_head.weight is model.model.wte.weight
    assert [f for f in frames if f"{Path('deepspeed')}/" in f] == []  # no DeepSpeed frame
    leaves = [getattr(block, "_z3_leaf", False) for block in model.model.blocks]
    assert leaves == [stage == 3] * len(leaves)
