"""Simulated nodes: one run of this script is one node of a Lightning job, launched as on
a cluster without a scheduler (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; the
Trainer's ``num_nodes=2``), each with its own local disk for torch's caches.

Usage: NODE_RANK=i MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
           python tests/nodes_run.py OUT_DIR DEVICES SCENARIO [SCENARIO ...]

Every scenario runs in turn in the same processes (one process group, set up once);
each gets fresh node-local cache folders (``OUT_DIR/node<i>/<scenario>``), a reset
dynamo and zeroed cache counters, and writes what it saw to
``OUT_DIR/<scenario>_rank<r>.pt``. The blocks hold about 1M parameters each, so DDP's
gradient buckets (1 MB first, then 25 MB) cut them.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from helpers import (  # noqa: E402
    PAYOFF_STEPS,
    LenientRankOne,
    SlowAotEager,
    WaitForTheSwitch,
    is_running,
)
from helpers import trainer as make_trainer  # noqa: E402

from lightning_regions import (  # noqa: E402
    RegionalCompileDDPStrategy,
    RegionalCompileFSDPStrategy,
    TiedWeightsCheck,
    region_report,
)
from lightning_regions.compat import cache_counts, dynamo_counters  # noqa: E402

WIDTH, HIDDEN, DEPTH, VOCAB, LENGTH = 512, 1024, 4, 64, 16
STEPS = 4
#: The gate's scenarios train PAYOFF_STEPS: at 0.1 these losses (about 500 at first) diverge.
GATE_LR = 1e-3


class WideBlock(nn.Module):
    """LayerNorm, 512 -> 1024 -> 512 with GELU, residual: 1.05M parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BreakingBlock(WideBlock):
    """A block with a real graph break inside: the part after it runs as another graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(self.norm(x)))
        torch._dynamo.graph_break()
        return x + self.down(hidden)


class WideNet(nn.Module):
    """Tokens through ``DEPTH`` wide blocks, the head tied to the embedding."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WideStack(pl.LightningModule):
    """``WideNet`` trained on next-token prediction."""

    def __init__(self, block: type[nn.Module] = WideBlock, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = WideNet(block)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class UserShardedStack(WideStack):
    """FSDP2 as Lightning's docs shard it: each block, then the model."""

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def tokens() -> torch.utils.data.DataLoader:
    data = torch.randint(0, VOCAB, (64, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(data, batch_size=4)


def node_cache(out: Path, scenario: str, phase: str = "") -> str:
    """A node-local cache folder, new for each scenario (and phase)."""
    node = os.environ.get("NODE_RANK", "0")
    return str(out / f"node{node}" / f"{scenario}{phase}")


def fit(
    out: Path, devices: int, model: WideStack, strategy: Any, steps: int = STEPS, **options: Any
) -> pl.Trainer:
    callbacks = options.pop("callbacks", [])
    trainer = make_trainer(
        out, strategy, steps, [TiedWeightsCheck(), *callbacks], devices=devices, num_nodes=2
    )
    trainer.fit(model, tokens(), **options)
    return trainer


def ddp(**options: Any) -> RegionalCompileDDPStrategy:
    return RegionalCompileDDPStrategy(process_group_backend="gloo", **options)


class KillTheChild(pl.Callback):
    """Kill the background child after the second step: a child that dies mid-compile."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        background = trainer.strategy.background
        if trainer.global_step == 2 and background is not None and background.process:
            background.process.kill()


def scenario(name: str, out: Path, devices: int) -> dict[str, Any]:
    """Run scenario ``name`` on this node; what it saw."""
    seen: dict[str, Any] = {}
    model: WideStack
    if name == "plain_ddp":
        model = WideStack()
        trainer = fit(out, devices, model, DDPStrategy(process_group_backend="gloo"))
    elif name in ("regional_ddp", "split_ddp"):
        if name == "split_ddp":  # the user's own choice: regions compiled in DDP's pieces
            torch._dynamo.config.optimize_ddp = "ddp_optimizer"
        model = WideStack()
        trainer = fit(out, devices, model, ddp(backend="aot_eager"))
        torch._dynamo.config.optimize_ddp = False  # our own run sets it; not the next one's
    elif name == "gate_plain":  # plain DDP over the steps of the gate's scenario
        model = WideStack(lr=GATE_LR)
        trainer = fit(out, devices, model, DDPStrategy(process_group_backend="gloo"), PAYOFF_STEPS)
    elif name == "gate_ddp":  # rank 0's compiled calls slowed, global rank 1 lenient
        model = WideStack(lr=GATE_LR)
        # 0.25 s a block: these steps take 0.1-0.6 s on a loaded CPU, and 30 ms a block
        # was once within their noise (compiled 621.5 vs eager 630.6 ms, kept)
        strategy = ddp(backend=SlowAotEager(only_rank=0, seconds=0.25))
        trainer = fit(out, devices, model, strategy, PAYOFF_STEPS, callbacks=[LenientRankOne()])
        decision = strategy.payoff.decision
        seen["decision"] = None if decision is None else decision.chosen
        seen["said"] = str(decision)
        seen["blocks_compiled"] = [b._compiled_call_impl is not None for b in model.model.blocks]
    elif name == "graph_break_ddp":
        model = WideStack(BreakingBlock)
        trainer = fit(out, devices, model, ddp(backend="aot_eager"))
    elif name in ("background", "refused", "slow", "dead"):
        model = WideStack()
        # The slow and the dead child are stopped before their imports end, so the backend
        # is what the fallback compiles in the training process with: aot_eager, seconds
        # less on each node than inductor's cold compile.
        backend = "aot_eager" if name in ("slow", "dead") else "inductor"
        options = {"backend": backend, "compile_in_background": True}
        if name == "refused" and os.environ.get("NODE_RANK") == "1":
            os.environ["LIGHTNING_REGIONS_ARTIFACT_KEY"] = "another user's key"
        if name == "slow":
            options["background_timeout_s"] = 0.5
        wait = WaitForTheSwitch(seconds=0.2, after=3)
        extra = [KillTheChild()] if name == "dead" else []
        cache = node_cache(out, name)
        strategy = ddp(cache_dir=cache, **options)
        trainer = fit(out, devices, model, strategy, 1000, callbacks=[wait, *extra])
        os.environ.pop("LIGHTNING_REGIONS_ARTIFACT_KEY", None)
        background = trainer.strategy.background
        seen |= {
            "children": len(background.children),
            "running": [pid for pid in wait.pids if is_running(pid)],
            "steps_eager": background.steps_eager,
            "counts": wait.counts,
            "threads": {when: sorted(counts) for when, counts in wait.threads.items()},
        }
    elif name in ("resume", "fsdp_resume"):
        checkpoints = out / f"{name}_checkpoints"
        fsdp = name == "fsdp_resume"
        first = WideStack()

        def strategy(phase: str) -> Any:
            cache = node_cache(out, name, phase)
            if fsdp:
                return RegionalCompileFSDPStrategy(process_group_backend="gloo", cache_dir=cache)
            return ddp(cache_dir=cache)

        saving = ModelCheckpoint(dirpath=checkpoints, save_last=True)
        fit(out, devices, first, strategy("-first"), callbacks=[saving])
        torch._dynamo.reset()
        dynamo_counters.clear()
        model = WideStack()  # a fresh process's model, cold node-local caches
        last = str(checkpoints / "last.ckpt")
        trainer = fit(out, devices, model, strategy("-resumed"), 2 * STEPS, ckpt_path=last)
        seen["resumed_counts"] = cache_counts()
        seen["first_losses"] = first.losses  # the default mode's, from the first step
    elif name == "fsdp_plain":
        model = UserShardedStack()
        plain = ModelParallelStrategy(
            data_parallel_size=2 * devices, tensor_parallel_size=1, process_group_backend="gloo"
        )
        trainer = fit(out, devices, model, plain)
    elif name == "fsdp_regional":
        model = WideStack()
        trainer = fit(out, devices, model, RegionalCompileFSDPStrategy(backend="aot_eager"))
    else:
        raise ValueError(f"unknown scenario {name!r}")
    check = next(c for c in trainer.callbacks if isinstance(c, TiedWeightsCheck))
    seen |= {"losses": model.losses, "ties_intact": check.broken == []}
    if hasattr(trainer.strategy, "options"):  # ours: the regions' report
        report = region_report(model)
        seen["graphs"] = report.graphs
        seen["pieces"] = [split.pieces for split in report.ddp_split]
        seen["breaks"] = [entry.graphs_per_call for entry in report.breaks]
        seen["ran_eager"] = len(report.ran_eager)
    seen["global_rank"] = trainer.global_rank
    return seen


def main(out: Path, devices: int, names: list[str]) -> None:
    for name in names:
        torch._dynamo.reset()
        dynamo_counters.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            began = time.perf_counter()
            seen = scenario(name, out, devices)
        seen["seconds"] = time.perf_counter() - began
        seen["warnings"] = [
            f"{w.category.__name__}: {str(w.message)[:400]}"
            for w in caught
            if w.category.__module__.startswith("lightning_regions")
        ]
        torch.save(seen, out / f"{name}_rank{seen['global_rank']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
