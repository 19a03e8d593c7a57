"""Train (or resume) the example GPT once with RegionalCompileStrategy, in this process.

    python examples/resume_run.py --run-dir R --steps N [--cache-dir C] [--ckpt R/last.ckpt]

The strategy compiles into torch's own cache (``$TORCHINDUCTOR_CACHE_DIR``, else torch's
default), or into ``--cache-dir`` when given, and stores compile-cache artifacts in the
checkpoints it writes to ``--run-dir``. Prints one JSON line: the
first step's seconds, the losses, and torch's inductor / AOTAutograd cache counters.
Used by the warm-start test and ``benchmarks/warm_start.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.lightning_gpt import CharDataModule, GPTModule, StepTimer
from lightning_regions import RegionalCompileStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--cache-dir", default=None, help="default: torch's own cache")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu")
    parser.add_argument("--mode", default=None, help="inductor mode, e.g. reduce-overhead")
    parser.add_argument("--batches", type=int, default=1, help="distinct batches per epoch")
    args = parser.parse_args()

    data = CharDataModule(block_size=args.block_size, batch_size=4)
    model = GPTModule(
        vocab_size=data.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=2,
    )
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=RegionalCompileStrategy(cache_dir=args.cache_dir, mode=args.mode),
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        limit_train_batches=args.batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, pl.callbacks.ModelCheckpoint(dirpath=args.run_dir, save_last=True)],
    )
    trainer.fit(model, data, ckpt_path=args.ckpt)
    counters = torch._dynamo.utils.counters
    result = {
        "first_step_s": timer.first_step_seconds,
        "steady_step_ms": timer.steady_step_ms,
        "losses": model.losses,
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
