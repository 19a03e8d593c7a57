"""Lightning Fabric: the regional strategies and the tie check in a Fabric loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from processes import launch_env
from torch import nn

import lightning_regions.fabric as regional_fabric
from examples.fabric_gpt import SMALL, train
from examples.lightning_gpt import CharDataModule
from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import TieCheck, TiedWeightsError, region_report

SCRIPT = Path(__file__).parent.parent / "examples" / "fabric_gpt.py"


def fabric(strategy="auto") -> Fabric:
    return Fabric(accelerator="cpu", devices=1, strategy=strategy)


def regional(**kwargs) -> regional_fabric.RegionalCompileStrategy:
    return regional_fabric.RegionalCompileStrategy(backend="aot_eager", **kwargs)


def test_the_names_are_registered_with_fabric():
    assert "regional_compile" in STRATEGY_REGISTRY and "regional_compile_ddp" in STRATEGY_REGISTRY
    assert isinstance(fabric("regional_compile").strategy, regional_fabric.RegionalCompileStrategy)
    ddp = Fabric(accelerator="cpu", devices=2, strategy="regional_compile_ddp")
    assert isinstance(ddp.strategy, regional_fabric.RegionalCompileDDPStrategy)
    assert ddp.strategy.num_processes == 2


def test_the_summary_is_logged_after_the_first_optimizer_step(caplog):
    import logging

    caplog.set_level(logging.INFO)
    train(fabric(regional()), steps=2)
    assert "regional compile: 2 region(s)" in caplog.text
    assert "regional compile after first step: 1 graph(s) compiled" in caplog.text
    assert "0 region(s) called without a compiled call" in caplog.text


@pytest.mark.parametrize("move_to_device", [True, False])
def test_a_fabric_loop_matches_plain_fabric_with_regions_compiled_and_ties_kept(move_to_device):
    model, losses = train(fabric(regional()), steps=4, move_to_device=move_to_device)
    plain_model, plain_losses = train(fabric(), steps=4)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    gpt = model.module
    assert gpt.lm_head.weight is gpt.wte.weight and gpt.layers is gpt.blocks
    report = region_report(gpt)
    assert len(report.rows) == 2 and not report.never_ran_compiled
    for (name, p), (_, q) in zip(
        gpt.named_parameters(), plain_model.module.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_a_round_of_optimizers_is_one_step_of_the_loop():
    """``OptimizerRound``: a GAN's discriminator and generator steps are one round (the
    first step is a round of its own: no other optimizer is known to step yet); so are a
    critic's 3 steps and a generator step; an optimizer replaced holds none back once
    garbage, or once another stepped ``STALE_AFTER`` times in a round without it."""
    import gc

    from lightning_regions.strategies.fabric import OptimizerRound

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    generator, discriminator = sgd(), sgd()
    rounds = OptimizerRound()
    ends = [rounds.stepped(o) for o in (generator, discriminator) * 3]
    assert ends == [True, False, True, False, True, False]  # each round: D, then G
    rounds = OptimizerRound()
    ends = [rounds.stepped(o) for o in ([discriminator] * 3 + [generator]) * 3]
    assert ends == [True, True, True, False, True, False, False, True, False, False, False, True]
    replaced = sgd()  # a new generator optimizer; the old one still referenced
    assert [rounds.stepped(replaced), rounds.stepped(discriminator)] == [False, False]
    del generator
    gc.collect()
    assert [rounds.stepped(replaced), rounds.stepped(discriminator)] == [True, False]
    rounds, kept_alive = OptimizerRound(), sgd()  # replaced, but still referenced
    assert rounds.stepped(kept_alive)
    ends = [rounds.stepped(replaced) for _ in range(OptimizerRound.STALE_AFTER + 2)]
    assert ends == [False] * OptimizerRound.STALE_AFTER + [True, True]


def test_a_second_module_set_up_with_compile_in_background_is_refused_before_it_trains():
    """The background mode compiles one module in one child: a second module set up on
    the same strategy (a GAN's discriminator) is refused at its setup, naming both
    modules and the two fixes, not left eager."""
    strategy = regional(compile_in_background=True)
    runner = fabric(strategy)
    generator, discriminator = TinyGPT(GPTConfig(**SMALL)), nn.Sequential(nn.Linear(4, 1))
    try:
        runner.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
        with pytest.raises(ValueError) as refused:
            runner.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    finally:
        strategy.teardown()
    said = str(refused.value)
    assert "compile_in_background=True" in said and "TinyGPT is already set up" in said
    assert "setting up Sequential too" in said and "nn.ModuleDict" in said
    assert "compile_in_background=False" in said


@pytest.mark.parametrize("granularity", ["regions", "nested"])
def test_torch_save_after_a_fabric_loop_loads_a_plain_model_with_the_same_outputs(
    tmp_path, granularity
):
    model, _ = train(fabric(regional(granularity=granularity)), steps=2)
    gpt = model.module
    torch.save(gpt, tmp_path / "gpt.pt")
    loaded = torch.load(tmp_path / "gpt.pt", weights_only=False)
    assert not [m for m in loaded.modules() if m._compiled_call_impl is not None]
    x = torch.randint(0, CharDataModule().vocab_size, (2, 16))
    gpt.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), gpt(x), rtol=0, atol=0)


def test_fabric_save_and_load_round_trip_with_the_plain_models_keys(tmp_path):
    f = fabric(regional())
    model, _ = train(f, steps=2)
    f.save(tmp_path / "state.ckpt", {"model": model})
    saved = torch.load(tmp_path / "state.ckpt", weights_only=True)["model"]
    vocab = CharDataModule().vocab_size
    plain = TinyGPT(GPTConfig(vocab_size=vocab, **SMALL))
    assert set(saved) == set(plain.state_dict())
    plain.load_state_dict(saved, strict=True)
    restored, _ = train(fabric(regional()), steps=0)
    f.load(tmp_path / "state.ckpt", {"model": restored})
    for (name, p), (_, q) in zip(
        restored.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, msg=name)


def broken_after_setup(breakage: str):
    """A Fabric-set-up GPT with its tie or its alias broken after setup."""
    f = fabric(regional())
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=11, **SMALL))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ties = TieCheck(model)
    model, optimizer = f.setup(model, optimizer)
    gpt = model.module
    if breakage == "tie":
        gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())
    else:
        gpt.layers = nn.ModuleList(list(gpt.blocks))
    idx = torch.randint(0, 11, (2, 8))
    f.backward(model(idx).sum())
    optimizer.step()
    return ties, model, optimizer


def test_the_tie_check_names_a_tie_broken_after_setup():
    ties, model, optimizer = broken_after_setup("tie")
    message = r"tied parameter wte\.weight = lm_head\.weight: 2 distinct Parameters"
    with pytest.raises(TiedWeightsError, match=message) as info:
        ties.verify(model, optimizer)
    assert "missing from the optimizer" in str(info.value)


def test_the_tie_check_names_an_alias_broken_after_setup():
    ties, model, optimizer = broken_after_setup("alias")
    with pytest.raises(TiedWeightsError, match=r"module alias blocks = layers: 2 distinct"):
        ties.verify(model, optimizer)


def test_the_tie_check_can_warn_instead():
    ties, model, optimizer = broken_after_setup("tie")
    ties.on_failure = "warn"
    with pytest.warns(UserWarning, match="lm_head.weight"):
        assert len(ties.verify(model, optimizer)) == 1


def run_ddp(strategy: str, out: Path) -> list[dict]:
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", "2"]
    command += ["--steps", "3", "--backend", "aot_eager", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=launch_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{strategy}_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.ddp
def test_two_process_fabric_ddp_matches_plain_fabric_ddp(tmp_path):
    ours, plain = run_ddp("regional_compile_ddp", tmp_path), run_ddp("ddp", tmp_path)
    for rank in range(2):
        assert ours[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
        assert ours[rank]["tie_kept"] and ours[rank]["regions_compiled"] == 2
        assert plain[rank]["regions_compiled"] == 0
