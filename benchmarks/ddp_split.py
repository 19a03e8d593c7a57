"""Should dynamo's DDP optimizer split each region's graph at DDP's gradient buckets?

``torch._dynamo.config.optimize_ddp`` (on by default) compiles a graph that runs under
DDP in pieces cut at DDP's bucket boundaries, so that one bucket's all-reduce overlaps
the backward of the next piece. For regions the backward of the next region already
follows each region's gradients; this measures whether the split still pays. Two ways,
each 2-process DDP over gloo on this machine (``RegionalCompileDDPStrategy``, inductor),
fresh processes and an empty ``TORCHINDUCTOR_CACHE_DIR`` per start:

- ``whole``: the strategy's choice, each region compiled whole (``optimize_ddp`` off
  while it is set up);
- ``split``: ``torch._dynamo.config.optimize_ddp = True`` set by the user, which the
  strategy leaves alone: each region in pieces.

Per rank: the first step (the cold compile; wall and CPU of its process tree), the
steady step (median of the steps after the 5th), the pieces per region call and the
graph-break warnings. Medians over ``--rounds``, the ways interleaved.

    python benchmarks/ddp_split.py [--rounds 2] [--n-layer 16] [--n-embd 256]

Writes ``ddp_split.json`` and ``ddp_split.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import median_of, quiet_trainer, ranks_in_child, save_results  # noqa: E402

WAYS = ("whole", "split")
STEPS = 20


def train(way: str, size: dict[str, int], out: str) -> None:
    """Train ``STEPS`` steps on 2 CPU processes; each rank writes its figures to ``out``."""
    import lightning.pytorch as pl
    import torch

    from benchmarks.protocol import CpuClock
    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileDDPStrategy, RegionGraphBreakWarning
    from lightning_regions import region_report as report_of

    if way == "split":
        torch._dynamo.config.optimize_ddp = True  # the user's own setting: left alone
    data = CharDataModule(block_size=size["block_size"], batch_size=8)
    module = GPTModule(vocab_size=data.vocab_size, **size)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_fit_start(self, *args: object) -> None:
            self.cpu = CpuClock()
            self.began = time.perf_counter()

        def on_train_batch_end(self, *args: object) -> None:
            now = time.perf_counter()
            self.seconds.append(now - self.began)
            self.began = now
            if len(self.seconds) == 1:
                self.first_cpu = self.cpu.seconds()

    clock = Clock()
    strategy = RegionalCompileDDPStrategy(process_group_backend="gloo")
    trainer = quiet_trainer(strategy, steps=STEPS, callbacks=[clock], devices=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    report = report_of(module)
    result = {
        "first_step_s": clock.seconds[0],
        "first_step_cpu_s": clock.first_cpu,
        "steady_step_s": statistics.median(clock.seconds[5:]),
        "graphs": report.graphs,
        "pieces": max((split.pieces for split in report.ddp_split), default=1),
        "graph_break_warnings": sum(
            issubclass(w.category, RegionGraphBreakWarning) for w in caught
        ),
        "block_parameters": sum(p.numel() for p in module.model.blocks[0].parameters()),
    }
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def start(way: str, size: dict[str, int]) -> list[dict]:
    """One start in new processes with an empty cache; each rank's figures."""
    arguments = ("--child", way, "--size", json.dumps(size))
    return ranks_in_child(__file__, *arguments, ranks=2, fresh_cache=True)


def table(rounds: list[dict[str, list[dict]]]) -> str:
    lines = [
        "| way | rank | first step s (CPU s) | steady step s | graphs | pieces per call "
        "| graph-break warnings |",
        "|---|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        for rank in range(2):
            runs = [r[way][rank] for r in rounds]
            median = functools.partial(median_of, runs)
            lines.append(
                f"| {way} | {rank} | {median('first_step_s'):.1f} "
                f"({median('first_step_cpu_s'):.1f}) | {median('steady_step_s'):.3f} "
                f"| {median('graphs'):.0f} | {median('pieces'):.0f} "
                f"| {median('graph_break_warnings'):.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.child, json.loads(args.size), args.child_out)
        return
    size = {"block_size": 128, "n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds = []
    for index in range(args.rounds):
        order = WAYS if index % 2 == 0 else WAYS[::-1]
        rounds.append({way: start(way, size) for way in order})
    parameters = rounds[0]["whole"][0]["block_parameters"]
    markdown = (
        f"Tiny GPT ({args.n_layer} blocks of width {args.n_embd}: {parameters / 1e6:.2f}M "
        f"parameters each, batch 8 x 128 tokens), 2-process DDP over gloo, "
        f"RegionalCompileDDPStrategy, inductor on CPU; run {started} on "
        f"{os.uname().machine}, {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}; medians of {args.rounds} round(s), each start in "
        f"new processes with an empty cache. Command: `python benchmarks/ddp_split.py "
        f"--rounds {args.rounds}`.\n\n" + table(rounds)
    )
    save_results(args.out, "ddp_split", "cpu", markdown, {"size": size, "rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
