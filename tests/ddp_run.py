"""Two-process DDP over gloo on CPU, run as a script (Lightning re-launches it per rank).

Usage: python tests/ddp_run.py {regional,eager} OUT_DIR
Each rank writes its final parameters and losses to OUT_DIR/<mode>_rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.lightning_gpt import CharDataModule, GPTModule
from lightning_regions import RegionalCompileDDPStrategy, TiedWeightsCheck


def main(mode: str, out: Path) -> None:
    data = CharDataModule(block_size=16, batch_size=4)
    model = GPTModule(
        vocab_size=data.vocab_size, block_size=16, n_layer=3, n_head=2, n_embd=16, unique_blocks=2
    )
    if mode == "regional":
        strategy = RegionalCompileDDPStrategy(backend="eager", process_group_backend="gloo")
    else:
        strategy = "ddp"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TiedWeightsCheck()],
    )
    trainer.fit(model, data)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    compiled = model.model.blocks[0]._compiled_call_impl is not None
    payload = {"params": state, "losses": model.losses, "compiled": compiled}
    torch.save(payload, out / f"{mode}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
