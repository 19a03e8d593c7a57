"""The demo's first step, whole-model ``torch.compile`` against ours, on a quiet machine
and beside a known load.

The load is controlled: this script's own busy loops, one per busy core, running for the
whole of that condition. Each cold start is ``make demo``'s row process
(``examples/demo_table.run_in_fresh_process``) with an empty inductor cache, the two
variants interleaved, ``--repeats`` times per condition; the figures are medians. It
answers whether the saving holds when the cores are shared, which one demo run under an
uncontrolled load cannot.

    python benchmarks/first_step_load.py                     # busy cores 0 1 2, 3 repeats
    python benchmarks/first_step_load.py --busy 0 2 --repeats 5 --out /tmp/x

Writes ``first_step_load.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples import demo_table  # noqa: E402

VARIANTS = ("torch.compile", "lightning_regions")


def spin() -> None:
    """Keep one core busy until terminated."""
    while True:
        pass


def cold_start(name: str, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds to the first step of one demo row, from an empty cache."""
    with tempfile.TemporaryDirectory(prefix="first-step-cache-") as cache:
        row = demo_table.run_in_fresh_process(name, "inductor", demo_table.DEMO_SIZE, steps, cache)
    if row.error:
        raise RuntimeError(f"{name}: {row.error}")
    return row.time_to_first_step_s, row.first_step_cpu_s


def measure(busy: int, repeats: int, steps: int) -> dict[str, dict[str, object]]:
    """Every variant's cold starts with ``busy`` cores kept busy meanwhile."""
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
    for spinner in spinners:
        spinner.start()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    try:
        for _ in range(repeats):
            for name in VARIANTS:
                runs[name].append(cold_start(name, steps))
                print(f"busy {busy}: {name} {runs[name][-1]}", flush=True)
    finally:
        for spinner in spinners:
            spinner.terminate()
    return {
        name: {
            "wall_s": [wall for wall, _ in samples],
            "cpu_s": [cpu for _, cpu in samples],
            "median_wall_s": statistics.median(wall for wall, _ in samples),
            "median_cpu_s": statistics.median(cpu for _, cpu in samples),
        }
        for name, samples in runs.items()
    }


def markdown(results: dict[int, dict[str, dict[str, object]]], repeats: int) -> str:
    quiet = results.get(0)
    lines = [
        "# The demo's first step beside a known load",
        "",
        f"Busy cores: this script's own busy loops. Medians of {repeats} interleaved cold "
        "starts each (empty inductor cache, `make demo`'s row process).",
        "",
        "| busy cores | torch.compile wall (CPU) | ours wall (CPU) | ours / torch.compile, wall "
        "| slowdown vs quiet: torch.compile, ours |",
        "|---|---|---|---|---|",
    ]
    for busy, rows in sorted(results.items()):
        whole, ours = rows["torch.compile"], rows["lightning_regions"]
        slowdown = "-"
        if quiet and busy:
            slowdown = (
                f"{whole['median_wall_s'] / quiet['torch.compile']['median_wall_s']:.2f}x, "
                f"{ours['median_wall_s'] / quiet['lightning_regions']['median_wall_s']:.2f}x"
            )
        lines.append(
            f"| {busy} | {whole['median_wall_s']:.1f} s ({whole['median_cpu_s']:.1f} s) "
            f"| {ours['median_wall_s']:.1f} s ({ours['median_cpu_s']:.1f} s) "
            f"| {ours['median_wall_s'] / whole['median_wall_s']:.2f}x | {slowdown} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    results = {busy: measure(busy, args.repeats, args.steps) for busy in args.busy}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_step_load.json").write_text(json.dumps(results, indent=1))
    table = markdown(results, args.repeats)
    (args.out / "first_step_load.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
