"""How noisy is the demo's steady-step measurement on an idle machine, and on a busy one?
The data behind the demo's ``DISTURBED MEASUREMENT`` rule (``protocol.disturbance``).

The demo's rows are trained once, cold, each in its own process (``demo_table``), which
leaves each row's warm cache; then the steady-step measurement the demo makes
(``demo_table.measure_steady``: every row compiled again from its warm cache in one
process, interleaved rounds) runs ``--idle`` times on the machine as it is, and
``--loaded`` times beside a CPU-bound load on every core (busy Python loops in processes
of their own). Per run: the largest uncertainty of a row's median and the cores other
programs used; then the verdict the protocol gives each run.

    python benchmarks/demo_noise.py [--idle 8] [--loaded 3]

Writes ``demo_noise.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import protocol  # noqa: E402
from benchmarks.harness import save_results  # noqa: E402
from examples import demo_table  # noqa: E402

SPIN = "import time\nwhile time.time() < {stop}:\n    sum(range(10_000))"


def other_program_load(seconds: float) -> list[int]:
    """Busy loops on every core for ``seconds``, as another program's: each is started
    through a shell that exits at once, so it is no process of this tree (whose CPU time
    the protocol takes out of "other programs")."""
    stop = time.time() + seconds
    pids = []
    for _ in range(os.cpu_count() or 1):
        code = SPIN.format(stop=stop)
        started = subprocess.run(
            ["sh", "-c", f'{sys.executable} -c "$0" >/dev/null 2>&1 & echo $!', code],
            capture_output=True,
            text=True,
            check=True,
        )
        pids.append(int(started.stdout))
    return pids


def one(rows: list[demo_table.Row], caches: dict[str, str], loaded: bool) -> dict:
    load = other_program_load(600) if loaded else []
    if load:
        time.sleep(2)
    try:
        steady = demo_table.measure_steady(rows, "inductor", demo_table.DEMO_SIZE, caches)
    finally:
        for pid in load:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    uncertainty = max(measured["uncertainty"] for measured in steady["rows"].values())
    return {
        "uncertainty": uncertainty,
        "other_cores": steady["other_cores"],
        "disturbed": protocol.disturbance([steady["other_cores"]], [uncertainty]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=8)
    parser.add_argument("--loaded", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    scratch = tempfile.mkdtemp(prefix="demo-noise-")
    try:
        caches = {name: os.path.join(scratch, name) for name in demo_table.ROWS}
        rows = [
            demo_table.run_in_fresh_process(
                name, "inductor", demo_table.DEMO_SIZE, 64, caches[name]
            )
            for name in demo_table.ROWS
        ]
        idle = [one(rows, caches, loaded=False) for _ in range(args.idle)]
        loaded = [one(rows, caches, loaded=True) for _ in range(args.loaded)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        "| run | machine | largest uncertainty | other cores | verdict |",
        "|---|---|---|---|---|",
    ]
    for label, runs in (("idle", idle), ("loaded", loaded)):
        for index, run in enumerate(runs, 1):
            verdict = f"DISTURBED ({run['disturbed']})" if run["disturbed"] else "quiet"
            lines.append(
                f"| {index} | {label} | +-{100 * run['uncertainty']:.1f}% | "
                f"{run['other_cores']:.2f} | {verdict} |"
            )
    worst = max(run["uncertainty"] for run in idle)
    markdown = (
        f"The demo's steady-step measurement ({demo_table.STEADY_ROUNDS} interleaved rounds of "
        f"{demo_table.STEADY_STEPS} steps, one intra-op thread), {args.idle} times idle and "
        f"{args.loaded} times beside {os.cpu_count()} busy loops. Run {started} on "
        f"{os.uname().machine}, {os.cpu_count()} cores. Rule in force: disturbed above "
        f"{protocol.BUSY_CORES} other cores or +-{100 * protocol.UNCERTAINTY_LIMIT:.0f}% "
        f"uncertainty. Command: `python benchmarks/demo_noise.py --idle {args.idle} "
        f"--loaded {args.loaded}`.\n\n"
        + "\n".join(lines)
        + f"\n\nIdle: largest uncertainty +-{100 * worst:.1f}% (median "
        f"+-{100 * statistics.median(r['uncertainty'] for r in idle):.1f}%), other cores at "
        f"most {max(r['other_cores'] for r in idle):.2f}.\n"
    )
    save_results(args.out, "demo_noise", "cpu", markdown, {"idle": idle, "loaded": loaded})
    print(markdown)


if __name__ == "__main__":
    main()
