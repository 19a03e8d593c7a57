"""What showing the compile costs a training step: the tiny GPT under
``RegionalCompileStrategy`` (inductor), trained with Lightning's tqdm bar drawing to a
pseudo-terminal (where the compile's status is drawn), the same with our status turned
off (``CompileStatus`` made inert: the bar's own cost), and without a bar (where the
status is logged), in rounds that alternate the three in one process. Each fit's steady step is the
median of its steps after ``WARMUP``; the row gives the median over rounds of each, and
how many of our status threads were alive during the timed steps (none is the rule:
a thread exists only while torch compiles).

    python benchmarks/status_cost.py [--rounds 5] [--steps 120] [--out benchmarks/results]

Writes ``status_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import statistics
import struct
import sys
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import quiet_trainer, save_results  # noqa: E402

#: Steps left out of each fit's median: the compile and the first warm steps.
WARMUP = 20


def drain_terminal() -> tuple[object, threading.Thread]:
    """A pseudo-terminal of 40 x 200 as ``sys.stdout``, read (and dropped) by a thread."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))

    def drain() -> None:
        while True:
            try:
                if not os.read(master, 65536):
                    return
            except OSError:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return open(slave, "w", buffering=1), reader


def fit(with_bar: bool, steps: int, status: bool = True) -> dict[str, float]:
    """One fit; its steady step's median in ms and our status threads seen in it."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy
    from lightning_regions.strategies.status import CompileStatus, StatusThread

    class NoStatus(CompileStatus):
        def enter(self, plan: object, trainer: object) -> None:
            pass

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.threads = 0

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())
            if len(self.starts) > WARMUP:
                names = [t.name for t in threading.enumerate()]
                self.threads += names.count(StatusThread.NAME)

    data = CharDataModule(block_size=64, batch_size=8)
    model = GPTModule(vocab_size=data.vocab_size, block_size=64, n_layer=8, n_head=4, n_embd=64)
    times = StepTimes()
    callbacks: list[object] = [times]
    stdout = sys.stdout
    if with_bar:
        sys.stdout, _ = drain_terminal()
        callbacks.append(TQDMProgressBar())
    try:
        strategy = RegionalCompileStrategy(keep_if_faster=False)
        if not status:
            strategy.status = NoStatus()
        trainer = quiet_trainer(
            strategy, steps=steps, callbacks=callbacks, enable_progress_bar=with_bar
        )
        trainer.fit(model, data)
    finally:
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
    gaps = [b - a for a, b in zip(times.starts[WARMUP:], times.starts[WARMUP + 1 :], strict=False)]
    return {"step_ms": 1000 * statistics.median(gaps), "status_threads": times.threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    ways = {"bar": (True, True), "bar, status off": (True, False), "no bar": (False, True)}
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    fit(False, WARMUP + 2)  # the first compile, cold: the rounds that follow are warm
    for _ in range(args.rounds):
        for way, (with_bar, status) in ways.items():
            runs[way].append(fit(with_bar, args.steps, status))
    medians = {way: statistics.median(r["step_ms"] for r in rs) for way, rs in runs.items()}
    threads = {way: sum(int(r["status_threads"]) for r in rs) for way, rs in runs.items()}
    lines = [
        "# The compile's status: the steady step with and without a bar",
        "",
        f"Tiny GPT (depth 8, width 64, batches of 8 x 64), `RegionalCompileStrategy` "
        f"(inductor, `keep_if_faster=False`), {args.rounds} rounds alternating a fit with "
        "Lightning's tqdm bar in a pseudo-terminal, the same with our status turned off, "
        f"and one without a bar, {args.steps} steps each; each fit's median step after "
        f"its first {WARMUP}, then the median over rounds.",
        "",
        "| | steady step (ms) | per round (ms) | our status threads alive in timed steps |",
        "|---|---|---|---|",
    ]
    for way, rs in runs.items():
        per_round = ", ".join(f"{r['step_ms']:.2f}" for r in rs)
        lines.append(f"| {way} | {medians[way]:.2f} | {per_round} | {threads[way]} |")
    ratio = medians["bar"] / medians["bar, status off"]
    lines += ["", f"Our status's cost, the bar with it / without it: {ratio:.3f}x."]
    data = {"runs": runs, "medians_ms": medians, "status_threads": threads, "ratio": ratio}
    save_results(args.out, "status_cost", "cpu", "\n".join(lines), data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
