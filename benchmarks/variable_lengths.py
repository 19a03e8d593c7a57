"""The keep-or-revert gate on batches of varying length: a decision on the ways, not on
the batches.

A 12-layer Llama-shaped decoder (transformers, from its config, random weights) trains
with ``RegionalCompileStrategy()`` (inductor, the gate on) on batches of 4 random texts
padded to the longest, each run in its own process with a fresh inductor cache, to the
gate's decision. From the same timed steps the table gives the gate's figures unscaled
(the medians as they were before ``gate.decision.at_one_size``) and scaled to one batch size
(what it decides on now), beside runs on texts of one length, whose batches never differ:
the reference for which way is faster.

    python benchmarks/variable_lengths.py                       # 6 seeds, lengths 16-256
    python benchmarks/variable_lengths.py --seeds 1 2 --width 64 --out /tmp/x

Writes ``variable_lengths.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import in_child, to_parent  # noqa: E402

from lightning_regions.gate.gate import MAX_WINDOWS, SETTLE, WINDOW  # noqa: E402

DEPTH = 12
BATCH = 4
#: Steps to the gate's latest decision (every window timed) and one more.
STEPS = 1 + SETTLE + 2 * WINDOW * MAX_WINDOWS + 1


def one_run(width: int, low: int, high: int, seed: int) -> dict:
    """Train to the decision in this process; the gate's timed steps and its verdict."""
    import random

    import lightning.pytorch as pl
    import torch
    from harness import quiet_trainer
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_regions import RegionalCompileStrategy
    from lightning_regions.gate.decision import at_one_size

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(
                vocab_size=128, hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=DEPTH, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max(high, 64),
            )  # fmt: skip
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            ids, mask = batch
            labels = ids.masked_fill(mask == 0, -100)
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def padded(texts):
        longest = max(len(text) for text in texts)
        ids = torch.zeros(len(texts), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            ids[row, : len(text)], mask[row, : len(text)] = text, 1
        return ids, mask

    rng = random.Random(seed)
    texts = [torch.randint(1, 128, (rng.randint(low, high),)) for _ in range(BATCH * STEPS)]
    loader = torch.utils.data.DataLoader(texts, batch_size=BATCH, collate_fn=padded)
    pl.seed_everything(seed, verbose=False)
    strategy = RegionalCompileStrategy()
    quiet_trainer(strategy, steps=STEPS).fit(LM(), loader)
    decision = strategy.payoff.decision
    clock = strategy.payoff.phases[0].clock
    records = clock.records()
    ms, elements = [s.ms for s in records], [s.elements for s in records]
    ways = [s.way for s in records]  # eager's turn first
    scaled, scaling = at_one_size(ms, elements, ways)

    def medians(steps: list[float]) -> dict[str, float]:
        return {
            "compiled_ms": statistics.median(steps[1::2]),
            "eager_ms": statistics.median(steps[0::2]),
        }

    return {
        "seed": seed,
        "lengths": [low, high],
        "steps_ms": ms,
        "elements": elements,
        "unscaled": medians(ms),
        "scaled": medians(scaled),
        "exponent": None if scaling is None else scaling.exponent,
        "decision": str(decision),
        "kept": decision.kept,
    }


def run_isolated(width: int, low: int, high: int, seed: int) -> dict:
    """``one_run`` in a new process with a fresh inductor cache."""
    with tempfile.TemporaryDirectory(prefix="variable-lengths-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "LIGHTNING_REGIONS_CACHE_DIR": cache}
        return in_child(__file__, "--child", *map(str, (width, low, high, seed)), env=env)


def markdown(runs: list[dict], args: argparse.Namespace) -> str:
    def ratio(figures: dict) -> float:
        return figures["compiled_ms"] / figures["eager_ms"]

    def verdict(figures: dict) -> str:
        return "kept" if ratio(figures) <= 0.99 else "reverted"

    lines = [
        f"# The gate on variable lengths: Llama-shaped decoder, depth {DEPTH}, width "
        f"{args.width}, batches of {BATCH} texts padded to the longest",
        "",
        "Each run in its own process with a fresh inductor cache, to the gate's decision "
        f"(step {STEPS - 1} at the latest); compiled / eager is the ratio of the gate's "
        "medians of its 4 steps each way (8 or 12 where turns disagreed): unscaled (as "
        "the gate decided before `payoff.at_one_size`), and "
        "scaled to the median batch's elements by `size^k` (what it decides on now). "
        "Kept where the ratio is at most 0.99.",
        "",
        "| texts | seed | batch elements | k | unscaled compiled / eager | decided so | "
        "scaled compiled / eager | decided so |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        low, high = run["lengths"]
        sizes = f"{min(run['elements']):,}-{max(run['elements']):,}"
        exponent = "-" if run["exponent"] is None else f"{run['exponent']:.2f}"
        lines.append(
            f"| {low}-{high} tokens | {run['seed']} | {sizes} | {exponent} | "
            f"{ratio(run['unscaled']):.3f} | {verdict(run['unscaled'])} | "
            f"{ratio(run['scaled']):.3f} | {verdict(run['scaled'])} |"
        )
    fixed = [ratio(run["scaled"]) for run in runs if run["lengths"][0] == run["lengths"][1]]
    varied = [run for run in runs if run["lengths"][0] != run["lengths"][1]]
    if fixed and varied:
        truth = "kept" if max(fixed) <= 0.99 else "reverted" if min(fixed) > 0.99 else "either"
        lines += [
            "",
            f"Texts of one length: compiled / eager {min(fixed):.3f}-{max(fixed):.3f} "
            f"(the right decision: {truth}). Variable lengths: unscaled, "
            f"{sum(verdict(r['unscaled']) == truth for r in varied)} of {len(varied)} runs "
            f"decided so; scaled, {sum(verdict(r['scaled']) == truth for r in varied)} of "
            f"{len(varied)} (the gate's own verdicts: "
            f"{sum(r['kept'] == (truth == 'kept') for r in varied)} of {len(varied)}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--fixed-seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", type=int, nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        to_parent(one_run(*args.child))
        return
    from harness import save_results

    low, high = args.lengths
    runs = [run_isolated(args.width, high, high, seed) for seed in args.fixed_seeds]
    runs += [run_isolated(args.width, low, high, seed) for seed in args.seeds]
    for run in runs:
        print(run["lengths"], run["seed"], run["decision"], flush=True)
    text = markdown(runs, args)
    print(text)
    save_results(args.out, "variable_lengths", "cpu", text, {"runs": runs})


if __name__ == "__main__":
    main()
