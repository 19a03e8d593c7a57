"""The keep-or-revert gate under a machine's load: how often it decides wrong, and what
timing another window where the turns disagree buys.

The gate's own code (``payoff.CompilePayoff``, over a model whose regions are compiled
in place) decides on scripted steps: eager 10 ms, compiled ``r`` times that, each step
times a lognormal noise (4%), and in 30% of runs (or none, the machine idle) a load from
elsewhere that lasts 2-12 steps, starting anywhere in the first 30 after the settling
ones, each step in it 1-6x longer. Its clock is the script's (``StepClock._now``);
nothing trains. Each ratio ``r`` runs with one window (as the gate was before
``MAX_WINDOWS``) and with ``MAX_WINDOWS``; wrong is a keep where ``r`` is above 0.99 or
a revert where it is at most 0.99.

    python benchmarks/gate_noise.py                  # 2,000 runs a ratio and setting
    python benchmarks/gate_noise.py --runs 200 --out /tmp/x

Writes ``gate_noise.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch import nn  # noqa: E402

from benchmarks.harness import save_results  # noqa: E402
from benchmarks.steady_step import OneProcess  # noqa: E402
from lightning_regions import compile_regions  # noqa: E402
from lightning_regions.core.calls import COMPILED  # noqa: E402
from lightning_regions.core.compile import use_region_calls  # noqa: E402
from lightning_regions.gate import gate as payoff  # noqa: E402
from lightning_regions.gate.clock import StepClock  # noqa: E402

RATIOS = (0.7, 0.9, 0.95, 1.05, 1.1, 1.34)
EAGER_MS, NOISE = 10.0, 0.04
#: The share of runs a load lands in: none (an idle machine), and 30%.
LOAD_SHARES = (0.0, 0.3)


def one_run(
    model: nn.Module, ratio: float, load_share: float, rng: random.Random
) -> tuple[bool, int]:
    """The gate over scripted steps of ``model`` (its regions compiled); whether it kept
    compiled, and at which step it decided."""
    use_region_calls(model, COMPILED)
    gate, now = payoff.CompilePayoff(), [0.0]
    load = None
    if rng.random() < load_share:
        start = rng.randrange(0, 30)
        load = range(start, start + rng.randint(2, 12))
    StepClock._now = lambda self: now[0]  # type: ignore[method-assign]
    settled = 1 + payoff.SETTLE
    for step in range(1, 200):
        eager = all(block._compiled_call_impl is None for block in model)
        ms = EAGER_MS * (1.0 if eager else ratio) * rng.lognormvariate(0, NOISE)
        if load is not None and step - settled - 1 in load:
            ms *= 1 + rng.uniform(0, 5)
        now[0] += ms / 1000
        decision = gate.at_step_boundary([model], OneProcess("cpu"))
        if decision is not None:
            return decision.kept, step
    raise RuntimeError("no decision")


def measure(runs: int, seed: int) -> list[dict]:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    compile_regions(model, inplace=True, backend="eager")  # its blocks are never run here
    clock_now, windows = StepClock._now, payoff.MAX_WINDOWS
    first = 1 + payoff.SETTLE + 2 * payoff.WINDOW  # the decision's step after one window
    rows = []
    try:
        for load_share, ratio, most in itertools.product(LOAD_SHARES, RATIOS, (1, windows)):
            payoff.MAX_WINDOWS = most
            rng = random.Random(seed)
            outcomes = [one_run(model, ratio, load_share, rng) for _ in range(runs)]
            wrong = sum(kept != (ratio <= 1 - payoff.EDGE) for kept, _ in outcomes)
            steps = [step for _, step in outcomes]
            rows.append(
                {
                    "load_share": load_share,
                    "ratio": ratio,
                    "max_windows": most,
                    "runs": runs,
                    "wrong": wrong,
                    "mean_decided_at": sum(steps) / runs,
                    "decided_after_one_window": sum(s == first for s in steps),
                }
            )
            print(rows[-1], flush=True)
    finally:
        StepClock._now, payoff.MAX_WINDOWS = clock_now, windows  # type: ignore[method-assign]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "# The keep-or-revert gate under load: one window against several",
        "",
        f"The gate's own code on scripted steps (`benchmarks/gate_noise.py`): eager "
        f"{EAGER_MS:.0f} ms, compiled that times the ratio, {NOISE:.0%} noise a step, and in "
        "the share of runs given a load of 2-12 steps at 1-6x. Wrong: kept where compiled "
        "is not 1% faster, or reverted where it is.",
        "",
        "| runs with a load | compiled / eager | windows at most | runs | wrong | "
        "decided at step (mean) | decided after one window |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['load_share']:.0%} | {row['ratio']} | {row['max_windows']} | {row['runs']} | "
            f"{row['wrong']} ({100 * row['wrong'] / row['runs']:.1f}%) | "
            f"{row['mean_decided_at']:.1f} | {row['decided_after_one_window']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    rows = measure(args.runs, args.seed)
    save_results(args.out, "gate_noise", "cpu", markdown(rows), {"rows": rows})


if __name__ == "__main__":
    main()
