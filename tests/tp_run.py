"""Tensor parallel + FSDP2 on a 2x2 mesh of 4 CPU processes (gloo), as torchtitan and
Lightning's docs shard: in ``configure_model``, ``ColwiseParallel`` on q, k, v and the
MLP's first linear, ``RowwiseParallel`` on both projections, then ``fully_shard`` on each
block and the model over the data-parallel mesh.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=4 \
           tests/tp_run.py OUT_DIR

Runs plain ``ModelParallelStrategy`` and ``RegionalCompileFSDPStrategy`` in turn in the
same 4 processes; each writes OUT_DIR/<mode>_rank<r>.pt (losses, graphs, the tie).
The model is defined here, in the script, as users write theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import trainer

from examples.lightning_gpt import CharDataModule
from lightning_regions import RegionalCompileFSDPStrategy, TiedWeightsCheck, region_report

WIDTH, HEADS, DEPTH, STEPS = 16, 2, 4, 4


class Attention(nn.Module):
    """Causal self-attention with q, k and v apart, so each shards by heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        head = WIDTH // HEADS  # the heads this process holds: its share of the width
        q, k, v = (
            f(x).view(batch, length, -1, head).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class TPGPT(pl.LightningModule):
    """A GPT of ``DEPTH`` blocks with its head tied to the embedding."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, WIDTH), nn.Embedding(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if isinstance(self.blocks[0], FSDPModule):
            return  # sharded already (a second setup)
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.blocks:
            plan: dict[str, Any] = {f"attn.{name}": ColwiseParallel() for name in "qkv"}
            plan |= {"attn.proj": RowwiseParallel(), "fc": ColwiseParallel()}
            plan |= {"proj": RowwiseParallel()}
            parallelize_module(block, tp, plan)
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)  # the embeddings, the tied head and the final norm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run(mode: str, out: Path) -> None:
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 2, "process_group_backend": "gloo"}
    if mode == "plain":
        strategy: ModelParallelStrategy = ModelParallelStrategy(**sizes)
    else:
        strategy = RegionalCompileFSDPStrategy(backend="aot_eager", **sizes)
    data = CharDataModule(block_size=16, batch_size=4)
    model = TPGPT(data.vocab_size)
    check = TiedWeightsCheck()
    fitted = trainer(out / mode, strategy, STEPS, [check], devices=4)
    fitted.fit(model, data)
    payload: dict[str, Any] = {
        "losses": model.losses,
        "tie": model.head.weight is model.wte.weight,
        "broken": check.broken,
        "mesh": tuple(fitted.strategy.device_mesh.mesh.shape),
    }
    if mode == "regional":
        report = region_report(model)
        payload["regions"] = len(report.rows)
        payload["graphs"] = sum(row.graphs for row in report.rows)
        payload["never_ran_compiled"] = len(report.never_ran_compiled)
    torch.save(payload, out / f"{mode}_rank{fitted.global_rank}.pt")


if __name__ == "__main__":
    for mode in ("plain", "regional"):
        run(mode, Path(sys.argv[1]))
