"""What lending threads and giving them back leaves behind: ``torch.set_num_threads``
against ``compat.limit_intra_op_threads``, on the tiny GPT's eager training step.

The background mode lends its child a core by running training on fewer intra-op threads
until the switch, then gives them back. ``torch.set_num_threads`` also turns MKL's
dynamic thread adjustment off for the rest of the process (pytorch#13868), where a
process that never called it keeps MKL's default (on); ``limit_intra_op_threads`` sets
OpenMP's and MKL's counts for the calling thread alone. Each run, in a fresh process:
``--steps`` eager steps (forward, backward, AdamW) of the tiny GPT (``examples/
tiny_gpt.py``, depth 16, width 16, batch 8 x 128 tokens: the background benchmark's
``--width 16`` model), timed; then the way's lend and give-back (the thread count halved
and put back; ``untouched``: nothing); then ``--steps`` more, timed. The figure is the
median step after over the median step before, in one process (this VM's speed drifts
between runs, less within one); rounds interleave the ways in a rotating order, and the
table gives the medians over rounds.

    python benchmarks/mkl_dynamic.py [--rounds 5] [--steps 100]

Writes ``mkl_dynamic.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import save_results  # noqa: E402

WAYS = ("untouched", "torch.set_num_threads", "limit_intra_op_threads")


def run(way: str, steps: int) -> dict[str, float]:
    """One process: the median step before and after ``way``'s lend and give-back."""
    import torch

    from examples.tiny_gpt import GPTConfig, TinyGPT
    from lightning_regions import compat

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(65, block_size=128, n_layer=16, n_head=4, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 65, (8, 128))

    def median_step() -> float:
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds) * 1000

    median_step()  # warm-up: the allocator, the first calls
    before = median_step()
    threads = torch.get_num_threads()
    if way == "torch.set_num_threads":
        torch.set_num_threads(max(1, threads // 2))
        median_step()
        torch.set_num_threads(threads)
    elif way == "limit_intra_op_threads":
        lent = compat.limit_intra_op_threads(max(1, threads // 2))
        median_step()
        compat.restore_intra_op_threads(lent)
    after = median_step()
    return {"before_ms": before, "after_ms": after, "ratio": after / before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child, args.steps)))
        return
    rounds: list[dict[str, dict[str, float]]] = []
    for index in range(args.rounds):
        order = WAYS[index % len(WAYS) :] + WAYS[: index % len(WAYS)]
        figures = {}
        for way in order:
            command = [sys.executable, __file__, "--child", way, "--steps", str(args.steps)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            figures[way] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {index + 1}: {way}: {figures[way]}", flush=True)
        rounds.append(figures)
    lines = [
        "| way | median step before ms | after ms | after / before (each round) | median |",
        "|---|---|---|---|---|",
    ]
    for way in WAYS:
        ratios = [r[way]["ratio"] for r in rounds]
        before = statistics.median(r[way]["before_ms"] for r in rounds)
        after = statistics.median(r[way]["after_ms"] for r in rounds)
        each = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        lines.append(
            f"| {way} | {before:.1f} | {after:.1f} | {each} | {statistics.median(ratios):.2f}x |"
        )
    markdown = (
        f"The tiny GPT's eager step (depth 16, width 16, batch 8 x 128), {args.steps} steps "
        f"before and after lending half the intra-op threads and giving them back, each run "
        f"in a fresh process; {args.rounds} interleaved rounds.\n\n" + "\n".join(lines)
    )
    save_results(args.out, "mkl_dynamic", "cpu", markdown, {"rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
