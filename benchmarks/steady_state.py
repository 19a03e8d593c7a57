"""What a compiled region costs per call once observation has ended.

12 tiny blocks (a user-defined class, so ``module.compile()`` really compiles them),
the ``eager`` backend so that the graph itself costs almost nothing and the call path
is what is measured. Two copies of one model: one with torch's ``module.compile()`` on
each block, one with ``compile_regions(inplace=True)`` after its observation window.
Rounds alternate between them; each round times ``CALLS`` forwards, and the minimum
over rounds is reported (the least disturbed round of each).

    python benchmarks/steady_state.py            # writes results/steady_state.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from harness import save_results
from torch import nn

from lightning_regions import compile_regions, region_report

ROOT = Path(__file__).resolve().parent
WIDTH, DEPTH, CALLS, ROUNDS = 16, 12, 200, 15


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class TinyStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def seconds_per_forward(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        model(x)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    source = TinyStack()
    torch_compiled, ours = copy.deepcopy(source), copy.deepcopy(source)
    for block in torch_compiled.blocks:
        block.compile(backend="eager")
    compile_regions(ours, inplace=True, backend="eager")
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        for _ in range(20):  # compile, then past the observation window
            torch_compiled(x), ours(x)
        report = region_report(ours)
        assert all(row.compiled_calls > 0 for row in report.rows), report
        times: dict[str, list[float]] = {"module.compile()": [], "compile_regions": []}
        for _ in range(ROUNDS):
            times["module.compile()"].append(seconds_per_forward(torch_compiled, x))
            times["compile_regions"].append(seconds_per_forward(ours, x))
    best = {name: min(values) for name, values in times.items()}
    ratio = best["compile_regions"] / best["module.compile()"]
    result = {
        "depth": DEPTH,
        "calls_per_round": CALLS,
        "rounds": ROUNDS,
        "best_us_per_forward": {name: 1e6 * value for name, value in best.items()},
        "ratio": ratio,
    }
    table = (
        "| 12-block forward, eager backend | best of rounds (us) | vs module.compile() |\n"
        "|---|---|---|\n"
        f"| `module.compile()` on each block | {1e6 * best['module.compile()']:.1f} | 1.00x |\n"
        f"| `compile_regions(inplace=True)`, after observation | "
        f"{1e6 * best['compile_regions']:.1f} | {ratio:.2f}x |\n"
    )
    save_results(args.out, "steady_state", "cpu", table, result)
    print(table)


if __name__ == "__main__":
    main()
