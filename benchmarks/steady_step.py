"""Steady-step time of each way to compile the tiny GPT, by the measurement protocol.

One process per (depth, intra-op threads), with a fresh inductor cache: every variant is
built and compiled in it, warmed, then timed in rounds interleaved across the variants
(``benchmarks/protocol.py``: the median of per-round medians, with its spread; other
programs' CPU use during the rounds, from ``/proc/stat``). One thread is the figure where
a ratio is the point: a single thread never waits at a barrier for a descheduled sibling.

    python benchmarks/steady_step.py                          # depths 4 16, threads 1 2
    python benchmarks/steady_step.py --depths 16 --threads 1 --rounds 40 --out /tmp/x
    python benchmarks/steady_step.py --profile 16             # where regions' time goes

Writes ``steady_step.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks import protocol  # noqa: E402

VARIANTS = ("eager", "whole", "accelerate", "regional_inplace", "nested", "torch_nested")
LABELS = {
    "eager": "eager",
    "whole": "whole-model `torch.compile`",
    "accelerate": "accelerate `compile_regions`",
    "regional_inplace": "ours, `regions`",
    "nested": "ours, `nested`",
    "torch_nested": "torch's nested, by hand",
}


def child(depth: int, threads: int, width: int, rounds: int, steps: int, device: str) -> dict:
    """Build, compile and warm every variant here; time them in interleaved rounds."""
    import torch
    from compile_time import build, step_once, synchronize

    torch.set_num_threads(threads)
    idx = torch.randint(0, 65, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    models, work = {}, {}
    for variant in VARIANTS:
        models[variant] = build(variant, depth, width, device)

        def step(model=models[variant]) -> None:
            step_once(model, idx)
            model.zero_grad(set_to_none=True)

        for _ in range(protocol.WARMUP_STEPS + 1):  # the first one compiles
            step()
        work[variant] = step
    load = protocol.OtherLoad()
    times = protocol.interleave(work, rounds, steps, clock=lambda: synchronize(device))
    estimates = {variant: protocol.estimate(rounds) for variant, rounds in times.items()}
    versus = {
        reference: {v: protocol.paired_ratio(t, times[reference]) for v, t in times.items()}
        for reference in ("whole", "accelerate")
    }
    return {
        "depth": depth,
        "threads": torch.get_num_threads(),
        "other_cores": load.cores(),
        "load_average": protocol.load_average(),
        "times": times,
        "ms": {v: 1000 * e.value for v, e in estimates.items()},
        "spread": {v: e.spread for v, e in estimates.items()},
        "uncertainty": {v: e.uncertainty for v, e in estimates.items()},
        "ratio": {ref: {v: e.value for v, e in by.items()} for ref, by in versus.items()},
        "ratio_uncertainty": {
            ref: {v: e.uncertainty for v, e in by.items()} for ref, by in versus.items()
        },
    }


def profile(depth: int, width: int, steps: int) -> str:
    """torch.profiler's table of one warm step of whole-model compile and of ours
    (regions), one thread: where the steady-step difference goes."""
    import torch
    from compile_time import build, step_once
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    idx = torch.randint(0, 65, (8, 128), generator=torch.Generator().manual_seed(0))
    tables = []
    for variant in ("whole", "regional_inplace"):
        model = build(variant, depth, width)
        for _ in range(protocol.WARMUP_STEPS + 1):
            step_once(model, idx)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step_once(model, idx)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        tables.append(f"## {variant}: {steps} warm steps, 1 thread\n\n```\n{table}\n```\n")
    return "\n".join(tables)


def run_isolated(depth: int, threads: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="inductor-steady-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, __file__, "--child", str(depth), str(threads)]
        command += ["--width", str(args.width), "--rounds", str(args.rounds)]
        command += ["--steps", str(args.steps), "--device", args.device]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"depth {depth}, {threads} thread(s) failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def table_lines(results: list[dict]) -> list[str]:
    """The table of steady steps and paired ratios, one row per (result, variant), each
    figure with its uncertainty."""
    lines = [
        "| depth | threads | variant | steady step (ms) | +- | vs whole | +- | vs accelerate "
        "| +- |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        ms, ratio, within = result["ms"], result["ratio"], result["ratio_uncertainty"]
        for variant in VARIANTS:
            lines.append(
                f"| {result['depth']} | {result['threads']} | {LABELS[variant]} | "
                f"{ms[variant]:.1f} | {100 * result['uncertainty'][variant]:.1f}% | "
                f"{ratio['whole'][variant]:.3f}x | {100 * within['whole'][variant]:.1f}% | "
                f"{ratio['accelerate'][variant]:.3f}x | "
                f"{100 * within['accelerate'][variant]:.1f}% |"
            )
    return lines


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    from harness import machine

    lines = [
        f"Machine: {machine()}, device {args.device}. Tiny GPT, width {args.width}, batch "
        f"8x128, forward and backward. Steady step: the median of {args.rounds} round "
        f"medians, {args.steps} steps per variant per round, rounds interleaved across the "
        f"variants in one process, after {protocol.WARMUP_STEPS} warm steps. Ratios: the "
        "median of per-round ratios (paired rounds). +-: the median's uncertainty (notch).",
        "",
        *table_lines(results),
    ]
    disturbed = protocol.disturbance(
        [r["other_cores"] for r in results],
        [u for r in results for by in r["ratio_uncertainty"].values() for u in by.values()],
    )
    others = ", ".join(
        f"depth {r['depth']}/{r['threads']}t: {r['other_cores']:.2f}"
        for r in results
        if r["other_cores"] is not None
    )
    lines += ["", f"Cores other programs used during the rounds: {others}."]
    if disturbed:
        lines.append(f"**Disturbed measurement**: {disturbed}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--profile", type=int, metavar="DEPTH")
    args = parser.parse_args()
    if args.child:
        depth, threads = args.child
        result = child(depth, threads, args.width, args.rounds, args.steps, args.device)
        print(json.dumps(result))
        return
    from harness import save_results

    if args.profile:
        text = profile(args.profile, args.width, args.steps)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "steady_step_profile.md").write_text(text)
        print(text)
        return
    results = []
    for depth in args.depths:
        for threads in args.threads:
            results.append(run_isolated(depth, threads, args))
            ratios = {v: round(r, 3) for v, r in results[-1]["ratio"]["whole"].items()}
            print(f"depth {depth} threads {threads}, vs whole: {ratios}", flush=True)
    text = markdown(results, args)
    save_results(args.out, "steady_step", args.device, text, {"results": results})
    print(text)


if __name__ == "__main__":
    main()
