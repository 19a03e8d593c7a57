"""One worker of a torchrun job of two agents (``--nnodes=2 --nproc-per-node=1``, c10d
rendezvous, ``--max-restarts=1``), each agent a simulated node with its own compile cache.

Usage (per agent): torchrun ... tests/restart_run.py OUT_DIR MODE
MODE: "regional" (inductor), "background" (inductor, ``compile_in_background=True``) or
"plain" (Lightning's DDP, eager: the uninterrupted reference).

Every worker fits to ``STEPS`` with ``ModelCheckpoint(save_last=True)`` every 4 steps
and ``ckpt_path="last"``, so a restarted worker resumes from the last checkpoint. In the
regional and background modes one worker, once in the job, kills itself (SIGKILL) after
step 4's checkpoint: in "regional" the one of agent 1, in "background" global rank 0,
the parent of the job's background child, while the child compiles. The killed worker
writes OUT_DIR/<mode>_killed.pt first; the worker that finishes on each agent writes
OUT_DIR/<mode>_node<agent>.pt, with its global rank (c10d's rendezvous gives ranks in
join order, so a restarted agent's worker may hold the other rank) and its restart count
(the agent of the killed worker counts a restart; the other restarts its worker as a
membership change, which torch does not count, or as a failure where its worker's next
collective fails on the closed connection first, which torch counts).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import trainer

from examples.lightning_gpt import CharDataModule, GPTModule
from lightning_regions import RegionalCompileDDPStrategy
from lightning_regions.compat import cache_counts

STEPS = 8
KILL_AFTER_STEP = 4


class KillAfterCheckpoint(pl.Callback):
    """SIGKILL this worker at the start of the step after ``KILL_AFTER_STEP``, once that
    step's checkpoint is on disk (Lightning's save ends in a barrier of every rank);
    first write what the test needs (the background child's pids)."""

    def __init__(self, out: Path, mode: str) -> None:
        self.out, self.mode = out, mode

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step != KILL_AFTER_STEP:
            return
        background = getattr(trainer.strategy, "background", None)
        killed = {
            "children": [child.pid for child in background.children]
            if background is not None
            else [],
            "switched": background is not None and background.switched,
            "global_rank": trainer.global_rank,
        }
        torch.save(killed, self.out / f"{self.mode}_killed.pt")
        os.kill(os.getpid(), signal.SIGKILL)


def main(out: Path, mode: str) -> None:
    node, attempt = os.environ["AGENT"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    name = f"{mode}_node{node}"
    data = CharDataModule(block_size=16, batch_size=4)
    model = GPTModule(
        vocab_size=data.vocab_size, block_size=16, n_layer=3, n_head=2, n_embd=16, unique_blocks=2
    )
    if mode == "plain":
        strategy: object = "ddp"
    else:
        strategy = RegionalCompileDDPStrategy(
            process_group_backend="gloo", compile_in_background=mode == "background"
        )
    # once per job: a worker restarted as a membership change still sees restart count 0
    killed_once = (out / f"{mode}_killed.pt").exists()
    kills = not killed_once and (
        (mode == "regional" and node == "1") or (mode == "background" and rank == 0)
    )
    checkpoints = ModelCheckpoint(
        dirpath=out / mode / "checkpoints", save_last=True, every_n_train_steps=4
    )
    callbacks = [checkpoints, *([KillAfterCheckpoint(out, mode)] if kills else [])]
    fitted = trainer(
        out / mode, strategy, STEPS, callbacks, num_nodes=2, devices=1, limit_train_batches=4
    )
    before = cache_counts()
    fitted.fit(model, data, ckpt_path="last")
    counts = {key: value - before.get(key, 0) for key, value in cache_counts().items()}
    background = getattr(fitted.strategy, "background", None)
    payload = {
        "losses": model.losses,
        "counts": counts,
        "global_step": fitted.global_step,
        "compiled": model.model.blocks[0]._compiled_call_impl is not None,
        "children": [child.pid for child in background.children] if background is not None else [],
        "restart_count": attempt,
        "global_rank": fitted.global_rank,  # c10d ranks go in join order: a restart may swap them
    }
    torch.save(payload, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
