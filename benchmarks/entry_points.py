"""``validate`` and ``predict`` alone with ``compile_in_background=True``: they run no
optimizer step, where the switch happens, so the regions compile at their start. What
that costs against eager, on the depth-16 GPT (width 256, inductor on this machine's
device), cold: each run in a fresh process with a fresh ``TORCHINDUCTOR_CACHE_DIR``,
``trainer.validate`` and ``trainer.predict`` over the training split (7 batches of 8 x 128
tokens), eager and with the strategy. Figures: the wall time of the whole call, its first
batch and a later batch (the median of the others). Medians over ``--rounds``.

    python benchmarks/entry_points.py [--rounds 2]

Writes ``entry_points.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import in_child, quiet_trainer, save_results, to_parent  # noqa: E402

SIZE = {"block_size": 128, "n_layer": 16, "n_head": 4, "n_embd": 256}
WAYS = ("eager", "lightning_regions, compile_in_background=True")
ENTRIES = ("validate", "predict")


def run(way: str, entry: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy

    data = CharDataModule(block_size=SIZE["block_size"], batch_size=8)
    data.setup("fit")
    loader = data.train_dataloader()
    module = GPTModule(vocab_size=data.vocab_size, **SIZE)
    strategy: Any = (
        "auto" if way == "eager" else RegionalCompileStrategy(compile_in_background=True)
    )

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.batches: list[float] = []

        def start(self, *args: object) -> None:
            self.began = time.perf_counter()

        def end(self, *args: object) -> None:
            self.batches.append(time.perf_counter() - self.began)

        on_validation_batch_start = on_predict_batch_start = start
        on_validation_batch_end = on_predict_batch_end = end

    clock = Clock()
    trainer = quiet_trainer(strategy, callbacks=[clock], limit_val_batches=None)
    began = time.perf_counter()
    getattr(trainer, entry)(module, loader)
    return {
        "seconds": time.perf_counter() - began,
        "first_batch": clock.batches[0],
        "later_batch": statistics.median(clock.batches[1:]),
        "batches": len(clock.batches),
    }


def fresh(way: str, entry: str) -> dict[str, Any]:
    return in_child(__file__, "--child", way, "--entry", entry, fresh_cache=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--entry", choices=ENTRIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        to_parent(run(args.child, args.entry))
        return
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds = [{f"{entry} | {way}": fresh(way, entry) for entry in ENTRIES for way in WAYS}]
    for _ in range(args.rounds - 1):
        rounds.append({f"{e} | {w}": fresh(w, e) for e in ENTRIES for w in WAYS})
    lines = [
        "| entry | way | whole call s | first batch s | later batch s |",
        "|---|---|---|---|---|",
    ]
    for key in rounds[0]:
        median = {k: statistics.median(r[key][k] for r in rounds) for k in rounds[0][key]}
        lines.append(
            f"| {key} | {median['seconds']:.1f} | {median['first_batch']:.2f} "
            f"| {median['later_batch']:.3f} |"
        )
    markdown = (
        f"Depth-16 GPT (width 256), {rounds[0][next(iter(rounds[0]))]['batches']} batches of 8 x "
        f"128 tokens, inductor on CPU, cold (a fresh process and cache each); medians of "
        f"{args.rounds} round(s). Run {started} on {os.uname().machine}, {os.cpu_count()} "
        f"cores, torch {__import__('torch').__version__}. Command: `python "
        f"benchmarks/entry_points.py --rounds {args.rounds}`.\n\n" + "\n".join(lines) + "\n"
    )
    save_results(args.out, "entry_points", "cpu", markdown, {"rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
