"""What Lightning's and PEFT's users already rely on, kept under the strategies: the
tie check on fine-tuning recipes, ``torch.save`` of a trained model and of the Trainer,
checkpoint folders and the working directory left as plain Lightning leaves them, a
remote ``default_root_dir``, torch's own compile cache, and ``strategy.load_checkpoint``
before a model is attached.

Built on Lightning's own ``BoringModel``, ``ModelCheckpoint`` and checkpoint connector,
each checked against plain Lightning where Lightning has something to compare with."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import lightning.pytorch as pl
import peft
import pytest
import torch
from helpers import VOCAB, SeenCacheDir, data, gpt, gpt2, llama, token_batches, trainer
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import (
    RegionalCompileStrategy,
    TiedWeightsCheck,
    TiedWeightsError,
    region_report,
)
from lightning_regions.cache import cache_dir_option
from lightning_regions.core.graph import model_class


def fit(
    root, strategy="auto", steps=3, callbacks=(), model=None, datamodule=None, **kwargs
) -> pl.Trainer:
    # Lightning's defaults for checkpoints and validation, as its own strategy tests run
    defaults = {"enable_checkpointing": True, "limit_val_batches": None}
    run = trainer(root, strategy, steps, callbacks, **{**defaults, **kwargs})
    run.fit(model if model is not None else BoringModel(), datamodule=datamodule)
    return run


# --- the compile cache: nothing until there is something to cache, never among checkpoints


def files_below(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("chosen", [None, "mine"])
def test_a_fit_whose_backend_writes_nothing_creates_no_folder_anywhere(
    tmp_path, monkeypatch, backend, chosen
):
    work, root = tmp_path / "work", tmp_path / "root"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "outside"))
    cache_dir = str(tmp_path / chosen / "cache") if chosen else None
    strategy = RegionalCompileStrategy(backend=backend, cache_dir=cache_dir)
    fit(root, strategy, callbacks=[ModelCheckpoint(dirpath=root)])
    assert os.listdir(root) == ["epoch=0-step=3.ckpt"]  # what plain Lightning writes
    assert os.listdir(work) == []
    assert sorted(os.listdir(tmp_path)) == ["root", "work"]  # neither cache folder made
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "outside")  # restored


@pytest.mark.inductor
def test_with_inductor_the_cache_is_torchs_and_the_checkpoint_folder_holds_checkpoints(
    tmp_path, monkeypatch
):
    work, root, users = tmp_path / "work", tmp_path / "root", tmp_path / "users_cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(users))
    fit(root, RegionalCompileStrategy(), callbacks=[ModelCheckpoint(dirpath=root)])
    assert os.listdir(root) == ["epoch=0-step=3.ckpt"]
    assert os.listdir(work) == []
    assert files_below(users)  # torch wrote its cache where the user said
    assert not (Path(os.environ["XDG_CACHE_HOME"]) / "lightning_regions").exists()


def test_a_remote_root_creates_no_local_folder_and_keeps_torchs_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users_cache"))
    seen = SeenCacheDir()
    trainer = fit("memory://run", RegionalCompileStrategy(backend="eager"), 2, [seen])
    assert os.listdir(tmp_path) == []  # no 'memory:' folder in the working directory
    assert seen.directory == str(tmp_path / "users_cache")
    assert trainer.checkpoint_callback.best_model_path.startswith("memory://run")


def test_cache_dir_names_a_folder_or_torchs_own_cache(tmp_path):
    assert cache_dir_option(None) is None and cache_dir_option(False) is None
    assert cache_dir_option(tmp_path / "shared") == str(tmp_path / "shared")
    with pytest.warns(DeprecationWarning, match="no longer keeps a cache folder per root"):
        assert cache_dir_option(True) is None
    for wrong in ("", 3):
        with pytest.raises(ValueError, match=f"cache_dir={wrong!r}: pass a folder path"):
            RegionalCompileStrategy(cache_dir=wrong)


# --- torch.save and deepcopy of what was trained ------------------------------------


def equal_outputs(first: nn.Module, second: nn.Module, x: torch.Tensor) -> None:
    first.eval(), second.eval()
    with torch.no_grad():
        torch.testing.assert_close(first(x), second(x), rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["regions", "nested"])
@pytest.mark.parametrize("name", ["boring", "gpt"])
def test_torch_save_after_fit_loads_a_plain_model_with_the_same_outputs(
    tmp_path, name, granularity
):
    model, datamodule = (BoringModel(), None) if name == "boring" else (gpt(), data())
    strategy = RegionalCompileStrategy(backend="aot_eager", granularity=granularity)
    trainer = fit(tmp_path, strategy, model=model, datamodule=datamodule)
    torch.save(model, tmp_path / "model.pt")
    torch.save(trainer, tmp_path / "trainer.pt")  # Lightning's own test saves both
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert [type(m) for m in loaded.modules()] == [model_class(m) for m in model.modules()]
    assert not [m for m in loaded.modules() if m._compiled_call_impl is not None]
    with pytest.raises(ValueError, match="not compiled by lightning_regions"):
        region_report(loaded)  # a plain model, as torch's own compiled modules load
    if name == "gpt":
        assert loaded.model.layers is loaded.model.blocks
        assert loaded.model.lm_head.weight is loaded.model.wte.weight
        x = torch.randint(0, data().vocab_size, (2, 16))
        equal_outputs(loaded.model, model.model, x)
        equal_outputs(copy.deepcopy(model).model, model.model, x)
    else:
        equal_outputs(loaded, model, torch.randn(4, 32))
        equal_outputs(copy.deepcopy(model), model, torch.randn(4, 32))


# --- strategy.load_checkpoint as Lightning allows it ------------------------------------


def test_load_checkpoint_is_callable_before_a_model_is_attached(tmp_path):
    trainer = fit(tmp_path, RegionalCompileStrategy(backend="eager"), 1)
    path = trainer.checkpoint_callback.best_model_path
    fresh = RegionalCompileStrategy(backend="eager")
    assert "state_dict" in fresh.load_checkpoint(path)  # no model at all
    fresh.connect(BoringModel())  # a model, not attached to a Trainer
    assert "state_dict" in fresh.load_checkpoint(path)
    # and as Lightning's checkpoint connector does it, on a new Trainer
    again = pl.Trainer(strategy=RegionalCompileStrategy(backend="eager"), default_root_dir=tmp_path)
    again._checkpoint_connector.resume_start(path)
    assert isinstance(again._checkpoint_connector._loaded_checkpoint, dict)


# --- the tie check on fine-tuning recipes -----------------------------------------------


class LoRA(pl.LightningModule):
    """peft LoRA on a transformers decoder, optimizer over the trainable parameters as
    every LoRA recipe writes it: the frozen tied embedding is in no optimizer."""

    def __init__(self, build, adapters: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout)
        self.model = peft.get_peft_model(build(), config)
        for index in range(1, adapters):
            self.model.add_adapter(f"second{index}", config)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit_lora(root, module: pl.LightningModule, strategy, check: TiedWeightsCheck) -> None:
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    trainer(root, strategy, 3, [check], limit_val_batches=None).fit(module, token_batches())


@pytest.mark.parametrize(
    ("build", "adapters", "dropout"),
    [(gpt2, 1, 0.0), (gpt2, 2, 0.1), (llama, 1, 0.0)],
    ids=["gpt2", "gpt2_two_adapters_dropout", "llama"],
)
def test_lora_with_a_trainable_only_optimizer_passes_the_tie_check_and_equals_plain(
    tmp_path, build, adapters, dropout
):
    ours, plain = LoRA(build, adapters, dropout), LoRA(build, adapters, dropout)
    check, plain_check = TiedWeightsCheck(on_failure="raise"), TiedWeightsCheck("raise")
    fit_lora(tmp_path, ours, RegionalCompileStrategy(backend="aot_eager"), check)
    fit_lora(tmp_path, plain, "auto", plain_check)
    assert check.broken == [] and plain_check.broken == []
    assert ours.losses == pytest.approx(plain.losses, rel=1e-6)
    report = region_report(ours)
    assert len(report.rows) == 12 and not report.never_ran_compiled  # the decoder layers
    if build is gpt2:  # the frozen tie was recorded and checked, not skipped
        tied = "model.base_model.model.transformer.wte.weight"
        assert any(tied in group for group in check.recorded.own_tie_groups())


class LoRABrokenTie(LoRA):
    """A setup step that unties GPT-2's frozen embedding and head."""

    def configure_model(self) -> None:
        gpt = self.model.base_model.model
        gpt.lm_head.weight = nn.Parameter(gpt.transformer.wte.weight.detach().clone(), False)


def test_a_tie_broken_during_setup_is_still_caught_under_lora(tmp_path):
    with pytest.raises(TiedWeightsError, match="2 distinct Parameters"):
        fit_lora(
            tmp_path,
            LoRABrokenTie(gpt2),
            RegionalCompileStrategy(backend="aot_eager"),
            TiedWeightsCheck(),
        )


class Finetuned(pl.LightningModule):
    """A tied, aliased backbone (frozen first by ``BackboneFinetuning``) and a new head;
    the optimizer holds what is trainable, and the callback adds the backbone later."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=12, n_embd=16)
        self.backbone = TinyGPT(config)
        self.head = nn.Linear(VOCAB, VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.backbone(batch))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_backbone_finetuning_passes_the_tie_check_and_equals_plain(tmp_path):
    runs = {}
    for name, strategy in (
        ("ours", RegionalCompileStrategy(backend="aot_eager")),
        ("plain", "auto"),
    ):
        module, check = Finetuned(), TiedWeightsCheck(on_failure="raise")
        unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        trainer(
            tmp_path,
            strategy,
            -1,
            [check, unfreeze],
            max_epochs=3,
            limit_train_batches=2,
            limit_val_batches=None,
        ).fit(module, token_batches())
        assert check.broken == []
        assert ("backbone.wte.weight", "backbone.lm_head.weight") in check.recorded.tie_groups
        assert len(module.trainer.optimizers[0].param_groups) == 2  # the backbone, added
        runs[name] = module.losses
    assert runs["ours"] == pytest.approx(runs["plain"], rel=1e-5)
