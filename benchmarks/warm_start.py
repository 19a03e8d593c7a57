"""First-step time of a resumed run: cold, warm cache directory, checkpoint artifacts.

Each start is its own process running ``examples/resume_run.py``:

- cold: an empty cache directory, no checkpoint;
- warm directory: resume from the cold run's checkpoint, reusing its cache directory;
- checkpoint artifacts: resume from the same checkpoint into a new, empty cache
  directory, so only the mega-cache artifacts stored in the checkpoint can help.

    python benchmarks/warm_start.py [--repeats 3] [--n-layer 4] [--n-embd 64] [--device cuda]

Writes ``warm_start.json`` and ``warm_start.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from harness import save_results

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "resume_run.py"


def accelerator(device: str) -> str:
    """Lightning's accelerator name for a torch device type."""
    return "gpu" if device.startswith("cuda") else "cpu"


def start(model_args: list[str], run: Path, cache: Path, steps: int, ckpt: Path | None) -> dict:
    command = [sys.executable, str(SCRIPT), "--run-dir", str(run), "--cache-dir", str(cache)]
    command += ["--steps", str(steps), *model_args] + (["--ckpt", str(ckpt)] if ckpt else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_repeat(model_args: list[str]) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        root = Path(tmp)
        cold = start(model_args, root / "a", root / "cache", 2, None)
        checkpoint = root / "a" / "last.ckpt"
        warm = start(model_args, root / "b", root / "cache", 3, checkpoint)
        artifacts = start(model_args, root / "c", root / "empty", 3, checkpoint)
        size_kb = checkpoint.stat().st_size / 1024
    return {
        "cold": cold,
        "warm_directory": warm,
        "checkpoint_artifacts": artifacts,
        "checkpoint_kb": {"first_step_s": size_kb},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    model_args = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    model_args += ["--block-size", "64", "--accelerator", accelerator(args.device)]

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = [one_repeat(model_args) for _ in range(args.repeats)]
    kinds = ("cold", "warm_directory", "checkpoint_artifacts")
    first = {k: statistics.median(run[k]["first_step_s"] for run in runs) for k in kinds}
    lines = [
        f"Tiny GPT ({args.n_layer} blocks, width {args.n_embd}), inductor on {args.device}, "
        f"medians of {args.repeats} repeat(s), every start in its own process. Run {started} "
        f"on {os.uname().machine}, {os.cpu_count()} cores, torch {version('torch')}. "
        f"Command: `python benchmarks/warm_start.py --repeats {args.repeats}`.",
        "",
        "| start | first step (s) | vs cold | inductor graph cache hits / misses |",
        "|---|---|---|---|",
    ]
    for kind in kinds:
        hits = statistics.median(run[kind]["fxgraph_hit"] for run in runs)
        misses = statistics.median(run[kind]["fxgraph_miss"] for run in runs)
        lines.append(
            f"| {kind.replace('_', ' ')} | {first[kind]:.1f} | {first[kind] / first['cold']:.2f}x "
            f"| {hits:.0f} / {misses:.0f} |"
        )
    size = statistics.median(run["checkpoint_kb"]["first_step_s"] for run in runs)
    lines.append(f"\nCheckpoint size with artifacts: {size:.0f} KB.")
    markdown = "\n".join(lines) + "\n"
    save_results(args.out, "warm_start", args.device, markdown, {"runs": runs, "medians": first})
    print(markdown)


if __name__ == "__main__":
    main()
