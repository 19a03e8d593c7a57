"""Lightning parts of the demo: the tiny GPT as a LightningModule, and a character-level
DataModule over the bundled public-domain text (the 1776 Declaration of Independence).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from examples.tiny_gpt import GPTConfig, TinyGPT

DATA = Path(__file__).parent / "data" / "declaration.txt"


class CharChunks(Dataset):
    """Consecutive, non-overlapping ``(input, target)`` chunks of a token sequence."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(pl.LightningDataModule):
    """Characters of a bundled text, 90% for training and 10% for validation."""

    def __init__(self, path: str = str(DATA), block_size: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        text = Path(path).read_text(encoding="utf-8")
        self.vocab = sorted(set(text))
        self.tokens = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.block_size = block_size
        self.batch_size = batch_size

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _loader(self, tokens: torch.Tensor) -> DataLoader:
        return DataLoader(CharChunks(tokens, self.block_size), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.tokens[: int(0.9 * len(self.tokens))])

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.tokens[int(0.9 * len(self.tokens)) :])

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class GPTModule(pl.LightningModule):
    """``TinyGPT`` trained with AdamW; logs loss, perplexity and next-character accuracy.

    ``unique_blocks=1`` gives the ALBERT-style variant: one block at every position.
    ``gradient_checkpointing=True`` wraps each block call in ``torch.utils.checkpoint``.
    """

    def __init__(
        self,
        vocab_size: int = 65,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 32,
        unique_blocks: int | None = None,
        gradient_checkpointing: bool = False,
        lr: float = 3e-3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        config = GPTConfig(
            vocab_size, block_size, n_layer, n_head, n_embd, unique_blocks, gradient_checkpointing
        )
        self.model = TinyGPT(config)
        self.val_perplexity = Perplexity()
        self.val_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        idx, targets = batch
        loss = self.model.loss(idx, targets)
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, targets = batch
        logits = self(idx)
        self.val_perplexity.update(logits, targets)
        self.val_accuracy.update(logits.flatten(0, 1), targets.flatten())
        self.log("val_accuracy", self.val_accuracy)
        self.log("val_perplexity", self.val_perplexity, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _synchronize(trainer: pl.Trainer) -> None:
    """On a GPU, wait for the queued kernels, so that step times include them."""
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize()


class StepTimer(pl.Callback):
    """Wall time of each training step; the first one includes compilation.

    ``time_to_first_step_seconds`` runs from the start of ``fit`` to the end of the first
    training step: the sanity check, and the eval graph it compiles, are included.
    """

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0
        self._fit_start = 0.0
        self.time_to_first_step_seconds = 0.0

    def on_fit_start(self, *args: object) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        _synchronize(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        _synchronize(trainer)
        now = time.perf_counter()
        self.seconds.append(now - self._start)
        if len(self.seconds) == 1:
            self.time_to_first_step_seconds = now - self._fit_start

    @property
    def first_step_seconds(self) -> float:
        return self.seconds[0]

    @property
    def steady_step_ms(self) -> float:
        return 1000 * statistics.median(self.seconds[len(self.seconds) // 2 :])
