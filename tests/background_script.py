"""A training script as users write one: the model's classes are defined right here (run
as ``__main__``), or with ``--in-function`` inside a function, and trained with
``RegionalCompileStrategy(compile_in_background=True)`` on inductor, then with the
default mode from the same initial weights.

Usage: python tests/background_script.py OUT.json [--in-function]

Writes what the tests check: each run's losses, torch's cache hits and misses over the
first compiled step and the first validation after the switch, the children started, their
rounds and whether any still runs, and the warnings given.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from helpers import WaitForTheSwitch, is_running, trainer  # noqa: E402

from lightning_regions import RegionalCompileStrategy  # noqa: E402

WIDTH, DEPTH, VOCAB, LENGTH = 16, 3, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(pl.LightningModule):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.losses: list[float] = []

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def block_in_a_function() -> type[nn.Module]:
    class LocalBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 2 * WIDTH)
            self.down = nn.Linear(2 * WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x))))

    return LocalBlock


def batches() -> torch.utils.data.DataLoader:
    """8 batches an epoch, the last of 2 sequences (a variable last batch)."""
    tokens = torch.randint(0, VOCAB, (30, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(tokens, batch_size=4)


def train_both(block: type[nn.Module], root: str) -> dict:
    """The background mode until 3 steps after its switch, then the default mode for as
    many steps, both with validation every 4 steps and the default sanity check."""
    wait = WaitForTheSwitch(seconds=0.2, after=12)  # a variable last batch after the switch
    ours = Model(block)
    strategy = RegionalCompileStrategy(compile_in_background=True, keep_if_faster=False)
    options = {"val_check_interval": 4, "num_sanity_val_steps": 2, "limit_val_batches": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, strategy, 10_000, [wait], max_epochs=-1, **options).fit(
            ours, batches(), batches()
        )
    default = Model(block)
    torch._dynamo.reset()
    trainer(root, RegionalCompileStrategy(keep_if_faster=False), len(ours.losses), **options).fit(
        default, batches(), batches()
    )
    return {
        "losses": ours.losses,
        "default_losses": default.losses,
        "switch_step": wait.switch_step,
        "steps_eager": strategy.background.steps_eager,
        "counts": wait.counts,
        "pids": wait.pids,
        "rounds": sum(child.round for child in strategy.background.children),
        "running": [pid for pid in wait.pids if is_running(pid)],
        "warnings": sorted({f"{w.category.__module__}.{w.category.__name__}" for w in caught}),
        "messages": [str(w.message)[:300] for w in caught if "Background" in str(w.category)],
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    block = block_in_a_function() if "--in-function" in sys.argv else Block
    out.write_text(json.dumps(train_both(block, str(out.parent))))
