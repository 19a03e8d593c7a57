"""RegionalCompileStrategy and TiedWeightsCheck with a real Trainer on the tiny GPT."""

from __future__ import annotations

import copy
import logging
import os

import lightning.pytorch as pl
import pytest
import torch
from accelerate.utils import compile_regions as accelerate_compile_regions
from helpers import SMALL, FailsOnLayerNorm, SeenCacheDir, data, gpt, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from examples.lightning_gpt import CharDataModule, GPTModule
from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import (
    RegionalCompileDDPStrategy,
    RegionalCompileStrategy,
    RegionCompileError,
    TiedWeightsCheck,
    TiedWeightsError,
)


def test_compiled_training_matches_eager_training(tmp_path):
    compiled, eager = gpt(), gpt()
    eager.load_state_dict(compiled.state_dict())
    trainer(tmp_path, RegionalCompileStrategy(backend="eager")).fit(compiled, data())
    trainer(tmp_path, "auto").fit(eager, data())
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), eager.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    assert compiled.model.lm_head.weight is compiled.model.wte.weight
    assert compiled.model.blocks[0]._compiled_call_impl is not None


def test_every_trainer_function_sees_the_compiled_model_and_setup_twice_compiles_once(tmp_path):
    model = gpt()
    strategy = RegionalCompileStrategy(backend="eager")
    fit = trainer(tmp_path, strategy, steps=1)
    fit.fit(model, data())
    compiled = model.model.blocks[0]._compiled_call_impl
    fit.validate(model, data())
    fit.test(model, data())
    fit.predict(model, data())
    assert model.model.blocks[0]._compiled_call_impl is compiled


def test_registry_names_work(tmp_path):
    assert "regional_compile" in StrategyRegistry
    assert "regional_compile_ddp" in StrategyRegistry
    t = trainer(tmp_path, "regional_compile")
    assert isinstance(t.strategy, RegionalCompileStrategy)
    assert t.strategy.root_device == torch.device("cpu")
    t = pl.Trainer(strategy="regional_compile_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, RegionalCompileDDPStrategy)


def test_several_devices_on_the_single_device_strategy_raise(tmp_path):
    with pytest.raises(ValueError, match=r"RegionalCompileDDPStrategy.*'regional_compile_ddp'"):
        pl.Trainer(strategy=RegionalCompileStrategy(), accelerator="cpu", devices=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "inductr"}, "Unknown torch.compile backend 'inductr'"),
        ({"mode": "fast"}, "Unknown torch.compile mode 'fast'"),
        ({"mode": "default", "options": {"trace.enabled": True}}, "either mode= or options="),
    ],
)
def test_bad_arguments_raise_in_the_constructor(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RegionalCompileStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        RegionalCompileDDPStrategy(**kwargs)


def test_unmatched_regions_raise_at_setup_before_any_step(tmp_path):
    model = gpt()
    t = trainer(tmp_path, RegionalCompileStrategy(backend="eager", regions=["Transformer*"]))
    with pytest.raises(ValueError, match=r"\['Transformer\*'\] matched no module.*GPTBlock"):
        t.fit(model, data())
    assert model.losses == []


def test_a_module_already_compiled_whole_is_refused_at_setup(tmp_path):
    model = gpt()
    t = trainer(tmp_path, RegionalCompileStrategy(backend="eager"))
    with pytest.raises(ValueError, match=r"wrapped by torch\.compile"):
        t.fit(torch.compile(model, backend="eager"), data())
    model = gpt()
    model.compile(backend="eager")
    with pytest.raises(ValueError, match=r"compiled whole with \.compile\(\)"):
        trainer(tmp_path, RegionalCompileStrategy(backend="eager")).fit(model, data())
    assert model.losses == []


def test_checkpoint_written_while_compiled_loads_strictly_into_the_plain_module(tmp_path):
    model = gpt()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(tmp_path, RegionalCompileStrategy(backend="eager"), callbacks=[checkpoint])
    t.fit(model, data())
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    plain = gpt()
    plain.load_state_dict(state, strict=True)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param, dict(model.named_parameters())[name], msg=name)
    assert not any("_orig_mod" in key for key in state)


def test_resume_from_checkpoint_gives_the_uninterrupted_losses(tmp_path, caplog):
    # One batch per epoch: Lightning 2.6 does not replay a plain DataLoader's order
    # exactly after a resume (plain Lightning differs too), so the data is held fixed
    # and what must come back is the weights and the optimizer state. The resume, in the
    # process that compiled the blocks' code, compiles nothing new, and says why.
    def run(model, steps, root, **kwargs):
        checkpoint = ModelCheckpoint(dirpath=root, save_last=True)
        strategy = RegionalCompileStrategy(backend="eager")
        t = trainer(root, strategy, steps, [checkpoint], limit_train_batches=1)
        t.fit(model, data(), **kwargs)

    straight, first = gpt(), gpt()
    run(straight, 6, tmp_path / "a")
    run(first, 3, tmp_path / "b")
    resumed = gpt(seed=123)  # a different init: everything must come from the checkpoint
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run(resumed, 6, tmp_path / "b", ckpt_path=tmp_path / "b" / "last.ckpt")
    assert first.losses + resumed.losses == pytest.approx(straight.losses, rel=1e-5)
    assert (
        "after first step: 0 graph(s) compiled (the regions ran code compiled earlier in this "
        "process), 0 recompile(s)" in caplog.text
    )
    assert "0 region(s) called without a compiled call" in caplog.text


# --- the tie check ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "regional"])
def test_tie_check_passes_on_intact_ties(tmp_path, strategy, caplog):
    caplog.set_level(logging.INFO)
    check = TiedWeightsCheck()
    chosen = RegionalCompileStrategy(backend="eager") if strategy == "regional" else "auto"
    trainer(tmp_path, chosen, steps=2, callbacks=[check]).fit(gpt(), data())
    assert check.broken == []
    assert "tie check passed: 2 alias group(s), 1 tie group(s) intact" in caplog.text


class Sabotaged(GPTModule):
    """Breaks the tie in one of the ways seen in the wild."""

    def __init__(self, how: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.how = how
        if how == "meta":
            with torch.device("meta"):
                self.model = TinyGPT(self.model.config)

    def configure_model(self) -> None:
        if self.how == "assign":
            state = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(state, assign=True)
        elif self.how == "meta":
            self.model.to_empty(device="cpu")
            for param in self.model.parameters():
                nn.init.normal_(param, std=0.02)
        elif self.how == "device_move":  # a move that re-creates every parameter
            for module in self.model.modules():
                for name, param in list(module._parameters.items()):
                    if param is not None:
                        module._parameters[name] = nn.Parameter(param.detach().clone())

    def on_fit_start(self) -> None:
        if self.how == "new_parameter":  # after the optimizer exists: it keeps the old one
            weight = self.model.lm_head.weight
            self.model.lm_head.weight = nn.Parameter(weight.detach().clone())


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("assign", "2 distinct Parameters"),
        ("new_parameter", "missing from the optimizer"),
        ("meta", "2 distinct Parameters"),
        ("device_move", "2 distinct Parameters"),
    ],
)
def test_tie_check_names_each_broken_group(tmp_path, how, problem):
    model = Sabotaged(how, vocab_size=data().vocab_size, **SMALL)
    with pytest.raises(TiedWeightsError) as error:
        trainer(tmp_path, steps=3, callbacks=[TiedWeightsCheck()]).fit(model, data())
    message = str(error.value)
    assert "tied parameter model.wte.weight = model.lm_head.weight" in message
    assert problem in message
    assert len(model.losses) == 1  # caught right after the first optimizer step


def test_tie_check_names_broken_aliases_with_the_regional_strategy(tmp_path):
    model = Sabotaged("device_move", vocab_size=data().vocab_size, **SMALL)
    check = TiedWeightsCheck(on_failure="warn")
    strategy = RegionalCompileStrategy(backend="eager")
    with pytest.warns(UserWarning, match="alias/tie group"):
        trainer(tmp_path, strategy, steps=2, callbacks=[check]).fit(model, data())
    broken = {group.paths for group in check.broken}
    assert ("model.wte.weight", "model.lm_head.weight") in broken
    assert len(model.losses) == 2  # warn: training goes on


def test_tie_check_with_gradient_accumulation_checks_after_the_real_step(tmp_path):
    model = Sabotaged("new_parameter", vocab_size=data().vocab_size, **SMALL)
    with pytest.raises(TiedWeightsError):
        trainer(tmp_path, steps=3, callbacks=[TiedWeightsCheck()], accumulate_grad_batches=3).fit(
            model, data()
        )
    assert len(model.losses) == 3  # three micro-batches make the first optimizer step


class AccelerateCompiled(pl.LightningModule):
    """A tied LM compiled by accelerate's compile_regions (no alias: accelerate drops it)."""

    def __init__(self) -> None:
        super().__init__()
        base = TinyGPT(GPTConfig(vocab_size=data().vocab_size, block_size=16, n_embd=16))
        del base._modules["layers"]
        base.layers = list(base.blocks)  # a plain list: forward still works
        self.model = accelerate_compile_regions(base, backend="eager")

    def training_step(self, batch, batch_idx):
        return self.model.loss(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_tie_check_works_on_an_accelerate_compiled_model(tmp_path):
    check = TiedWeightsCheck()
    model = AccelerateCompiled()
    trainer(tmp_path, steps=2, callbacks=[check]).fit(model, data())
    assert check.broken == []
    assert ("model.wte.weight", "model.lm_head.weight") in check.recorded.own_tie_groups()


def test_tie_check_rejects_a_bad_policy():
    with pytest.raises(ValueError, match="on_failure='explode'"):
        TiedWeightsCheck(on_failure="explode")


def test_strategy_leaves_the_source_types_and_keys(tmp_path):
    model = gpt()
    keys = list(model.state_dict())
    before = copy.deepcopy(model)
    trainer(tmp_path, RegionalCompileStrategy(backend="eager"), steps=1).fit(model, data())
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]


# --- loud failures through the strategy ---------------------------------------------


def test_compile_error_policy_raise_raises_region_compile_error_naming_the_block(tmp_path):
    strategy = RegionalCompileStrategy(backend=FailsOnLayerNorm())
    with pytest.raises(RegionCompileError, match=r"Compiling region GPTBlock at model\.blocks\.0"):
        trainer(tmp_path, strategy, steps=1).fit(gpt(), data())


def test_compile_error_policy_eager_trains_on_and_loses_nothing(tmp_path):
    compiled, eager = gpt(), gpt()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    strategy = RegionalCompileStrategy(backend=FailsOnLayerNorm(), on_compile_error="eager")
    with pytest.warns(UserWarning, match=r"Region GPTBlock at model\.blocks\.0.*runs eager"):
        trainer(tmp_path, strategy, callbacks=[checkpoint]).fit(compiled, data())
    trainer(tmp_path, "auto").fit(eager, data())
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    gpt().load_state_dict(state, strict=True)


class VaryingLengths(CharDataModule):
    """Batches whose sequence length changes every step: a classic recompile storm."""

    def train_dataloader(self):
        tokens = self.tokens
        batches = [
            (tokens[: 4 * n].view(4, n), tokens[1 : 4 * n + 1].view(4, n)) for n in range(4, 12)
        ]
        return torch.utils.data.DataLoader(batches, batch_size=None)


def test_a_recompile_storm_warns_naming_the_block_and_torchs_reason(tmp_path):
    strategy = RegionalCompileStrategy(backend="eager", dynamic=False, recompile_warn_threshold=3)
    with pytest.warns(UserWarning, match=r"GPTBlock recompiled 3 times.*size mismatch"):
        trainer(tmp_path, strategy, steps=6).fit(gpt(), VaryingLengths(block_size=16, batch_size=4))


def test_the_cache_is_the_users_own_unless_a_folder_is_named_and_is_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users"))
    seen = [SeenCacheDir(), SeenCacheDir()]
    strategy = RegionalCompileStrategy(backend="eager")
    trainer(tmp_path, strategy, steps=1, callbacks=[seen[0]]).fit(gpt(), data())
    given = RegionalCompileStrategy(backend="eager", cache_dir=str(tmp_path / "mine"))
    trainer(tmp_path / "other", given, steps=1, callbacks=[seen[1]]).fit(gpt(), data())
    assert [s.directory for s in seen] == [str(tmp_path / "users"), str(tmp_path / "mine")]
    assert strategy.cache_dir is None and given.cache_dir == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users")
