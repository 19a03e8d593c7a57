"""The ranks of one node and torch's compile cache they share: does a rank's compile
benefit from another's?

Under ``RegionalCompileDDPStrategy`` every rank compiles the same regions at the same
moment into one ``TORCHINDUCTOR_CACHE_DIR`` (the user's, or torch's default: one per user
on a node). Three starts a round, each in fresh processes, inductor on CPU:

- ``1 process, cold``: ``RegionalCompileStrategy`` alone, an empty cache;
- ``2 ranks, cold``: 2-process DDP over gloo, both ranks in one new, empty cache;
- ``2 ranks, warm``: the same again in the cache the cold run left.

Each rank reports its first step (wall, and CPU time of its process tree) and torch's
FX-graph / AOTAutograd cache counters: hits on a rank of the cold run would mean it
found graphs the other rank had just written. Medians over ``--rounds``.

    python benchmarks/ddp_cache.py [--rounds 3] [--n-layer 8] [--n-embd 128]

Writes ``ddp_cache.json`` and ``ddp_cache.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import median_of, quiet_trainer, ranks_in_child, save_results  # noqa: E402


def train(devices: int, size: dict[str, int], out: str) -> None:
    """Train 2 steps on ``devices`` CPU processes; each rank writes its figures to ``out``."""
    import torch

    from examples.demo_table import FirstStepClock
    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileDDPStrategy, RegionalCompileStrategy

    data = CharDataModule(block_size=size["block_size"], batch_size=8)
    module = GPTModule(vocab_size=data.vocab_size, **size)
    strategy: Any = RegionalCompileStrategy()
    if devices > 1:
        strategy = RegionalCompileDDPStrategy(process_group_backend="gloo")
    clock = FirstStepClock()
    trainer = quiet_trainer(strategy, steps=2, callbacks=[clock], devices=devices)
    trainer.fit(module, data)
    counters = torch._dynamo.utils.counters
    result = {
        "first_step_s": clock.wall_s,
        "first_step_cpu_s": clock.cpu_s,
        "threads": torch.get_num_threads(),
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def start(devices: int, size: dict[str, int], cache: str) -> list[dict]:
    """One start in new processes; each rank's figures, by rank."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    arguments = ("--child", str(devices), "--size", json.dumps(size))
    return ranks_in_child(__file__, *arguments, ranks=devices, env=env)


def one_round(size: dict[str, int]) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory(prefix="ddp-cache-round-") as tmp:
        single = start(1, size, os.path.join(tmp, "single"))
        cold = start(2, size, os.path.join(tmp, "shared"))
        warm = start(2, size, os.path.join(tmp, "shared"))
    return {"1 process, cold": single, "2 ranks, cold": cold, "2 ranks, warm": warm}


def table(rounds: list[dict[str, list[dict]]]) -> str:
    lines = [
        "| start | rank | first step, wall s (CPU s) | threads | FX-graph hits / misses "
        "| AOTAutograd hits / misses |",
        "|---|---|---|---|---|---|",
    ]
    for start_name in rounds[0]:
        for rank in range(len(rounds[0][start_name])):
            runs = [r[start_name][rank] for r in rounds]
            median = functools.partial(median_of, runs)
            lines.append(
                f"| {start_name} | {rank} | {median('first_step_s'):.1f} "
                f"({median('first_step_cpu_s'):.1f}) | {runs[0]['threads']} "
                f"| {median('fxgraph_hit'):.0f} / {median('fxgraph_miss'):.0f} "
                f"| {median('aot_hit'):.0f} / {median('aot_miss'):.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.child, json.loads(args.size), args.child_out)
        return
    size = {"block_size": 64, "n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd}
    rounds = [one_round(size) for _ in range(args.rounds)]
    markdown = (
        f"Tiny GPT ({args.n_layer} blocks, width {args.n_embd}), RegionalCompileStrategy / "
        f"RegionalCompileDDPStrategy (gloo), inductor on CPU, {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}; medians of {args.rounds} round(s), each start "
        "in new processes.\n\n" + table(rounds)
    )
    save_results(args.out, "ddp_cache", "cpu", markdown, {"size": size, "rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
