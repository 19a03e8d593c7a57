"""Runs that repeat: a sweep's trials, each in a fresh process with its own root.

A user's sweep trains the same model several times (other learning rates, other seeds),
each trial a new process with a new ``default_root_dir``. torch's compile caches are keyed
by the graph, not by the run, so from the second trial on a compile is served from the
cache. This benchmark runs ``--trials`` such trials for each way of compiling, side by side:

- ``torch.compile``: plain Lightning with the GPT compiled whole (``model.compile()``);
- ``accelerate``: ``accelerate.utils.compile_regions`` on the GPT (its ``layers`` alias,
  which accelerate drops, replaced by a plain list);
- ``lightning_regions``: ``RegionalCompileStrategy()`` with its defaults.

The protocol (``protocol.py``): every variant's trials share one ``TORCHINDUCTOR_CACHE_DIR``
(the user's own, exported), fresh and empty for each round, so each round's first trial
is a cold start; rounds are interleaved (each round runs every variant, in turn, in a
rotating order); figures are medians over rounds; CPU time of the process tree beside
wall time; other programs' load named. Before the first round one throw-away inductor
compile builds what torch keeps outside ``TORCHINDUCTOR_CACHE_DIR`` (its precompiled
header), so that no variant pays it alone.

    python benchmarks/repeated_runs.py [--trials 3] [--rounds 3] [--n-layer 8] [--n-embd 128]

Writes ``repeated_runs.json`` and ``repeated_runs.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import in_child, quiet_trainer, save_results, to_parent  # noqa: E402

VARIANTS = ("torch.compile", "accelerate", "lightning_regions")
STEPS = 2


def train_trial(variant: str, size: dict[str, int], root: str) -> dict[str, Any]:
    """One trial in this process: Lightning trains the GPT for ``STEPS`` steps under
    ``variant``; the first step's wall and CPU seconds and torch's cache counters."""
    import torch

    from examples.demo_table import FirstStepClock
    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy

    data = CharDataModule(block_size=size["block_size"], batch_size=8)
    module = GPTModule(vocab_size=data.vocab_size, **size)
    strategy: Any = "auto"
    if variant == "torch.compile":
        module.model.compile()
    elif variant == "accelerate":
        from accelerate.utils import compile_regions

        gpt = module.model
        del gpt._modules["layers"]  # accelerate drops the alias; keep forward working
        gpt.layers = list(gpt.blocks)
        module.model = compile_regions(gpt)
    else:
        strategy = RegionalCompileStrategy()
    clock = FirstStepClock()
    quiet_trainer(strategy, steps=STEPS, callbacks=[clock], default_root_dir=root).fit(module, data)
    counters = torch._dynamo.utils.counters
    return {
        "first_step_s": clock.wall_s,
        "first_step_cpu_s": clock.cpu_s,
        "other_cores": clock.other_cores,
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def trial_in_fresh_process(variant: str, size: dict[str, int], cache: str, root: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    arguments = ("--child", variant, "--size", json.dumps(size), "--root", root)
    return in_child(__file__, *arguments, env=env)


def warm_torchs_own_files() -> None:
    """One throw-away inductor compile in a fresh cache: what torch keeps outside
    ``TORCHINDUCTOR_CACHE_DIR`` is then built before any variant's cold start."""
    code = "import torch; torch.compile(lambda x: (x * 2).sum())(torch.ones(4))"
    with tempfile.TemporaryDirectory(prefix="repeated-warmup-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)


def one_round(index: int, size: dict[str, int], trials: int) -> dict[str, list[dict]]:
    """Every variant's trials, the variants in an order rotated by ``index``; each
    variant's trials share a fresh cache, each trial has its own root."""
    order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="repeated-runs-") as tmp:
        for variant in order:
            cache = os.path.join(tmp, f"cache-{variant}")
            results[variant] = [
                trial_in_fresh_process(variant, size, cache, os.path.join(tmp, f"{variant}-{t}"))
                for t in range(trials)
            ]
    return results


def table(rounds: list[dict[str, list[dict]]], trials: int) -> str:
    def median(variant: str, trial: int, key: str) -> float:
        return statistics.median(r[variant][trial][key] for r in rounds)

    header = "| first step, wall s (CPU s) |"
    header += "".join(f" trial {t + 1} |" for t in range(trials))
    header += " FX-graph / AOTAutograd hits, misses on trials 2+ |"
    lines = [header, "|---" * (trials + 2) + "|"]
    for variant in VARIANTS:
        cells = [
            f"{median(variant, t, 'first_step_s'):.1f} "
            f"({median(variant, t, 'first_step_cpu_s'):.1f})"
            for t in range(trials)
        ]
        later = [run for r in rounds for run in r[variant][1:]]
        counts = "{}/{} hits, {}/{} misses".format(
            max(run["fxgraph_hit"] for run in later),
            max(run["aot_hit"] for run in later),
            max(run["fxgraph_miss"] for run in later),
            max(run["aot_miss"] for run in later),
        )
        lines.append(f"| {variant} | {' | '.join(cells)} | {counts} |")
    lines += ["", "Trial 2 against the others' trial 2 (median of per-round ratios):", ""]
    for other in ("torch.compile", "accelerate"):
        ratio = statistics.median(
            r["lightning_regions"][1]["first_step_s"] / r[other][1]["first_step_s"] for r in rounds
        )
        lines.append(f"- lightning_regions / {other}: {ratio:.2f}x")
    busy = max(run["other_cores"] or 0.0 for r in rounds for runs in r.values() for run in runs)
    lines.append(f"\nOther programs used up to {busy:.2f} cores during a first step.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--unique-blocks", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        to_parent(train_trial(args.child, json.loads(args.size), args.root))
        return
    size = {"block_size": 64, "n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd}
    if args.unique_blocks:
        size["unique_blocks"] = args.unique_blocks
    warm_torchs_own_files()
    rounds = [one_round(index, size, args.trials) for index in range(args.rounds)]
    markdown = (
        f"Tiny GPT ({args.n_layer} blocks, width {args.n_embd}), inductor on CPU, "
        f"{args.trials} trials a round in fresh processes with their own roots, sharing the "
        f"variant's TORCHINDUCTOR_CACHE_DIR (fresh each round); medians of {args.rounds} "
        f"interleaved rounds; torch {__import__('torch').__version__}, {os.cpu_count()} cores.\n\n"
        + table(rounds, args.trials)
    )
    save_results(args.out, "repeated_runs", "cpu", markdown, {"size": size, "rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
