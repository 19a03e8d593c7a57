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

VARIANTS = ("eager", "whole", "accelerate", "regional_inplace", "nested", "torch_nested", "gated")
#: Ours with ``keep_if_faster``'s gate (``payoff.CompilePayoff``) run to its decision.
GATED = "gated"
#: The gate's goal: after the decision, within this of the faster of eager and ours.
GATED_GOAL = 1.02
LABELS = {
    "eager": "eager",
    "whole": "whole-model `torch.compile`",
    "accelerate": "accelerate `compile_regions`",
    "regional_inplace": "ours, `regions`",
    "nested": "ours, `nested`",
    "torch_nested": "torch's nested, by hand",
    GATED: "ours, kept or reverted",
}


class OneProcess:
    """What the gate asks of the job's processes, for a loop of one process."""

    def __init__(self, device: str) -> None:
        import torch

        self.root_device = torch.device(device)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


def run_gate(model, step, device: str) -> str:
    """Train ``model`` (compiled by ``compile_regions(inplace=True)``) with the strategy's
    keep-or-revert gate on its own steps until it decides; the decision, as logged."""
    from lightning_regions.gate.gate import CompilePayoff

    payoff, processes = CompilePayoff(), OneProcess(device)
    while payoff.decision is None:
        step()
        payoff.at_step_boundary([model], processes)
    return str(payoff.decision)


def child(
    depth: int,
    threads: int,
    width: int,
    rounds: int,
    steps: int,
    device: str,
    variants: tuple[str, ...] = VARIANTS,
) -> dict:
    """Build, compile and warm every variant here (the gated one to its decision); time
    them in interleaved rounds."""
    import torch
    from compile_time import build, step_once, synchronize

    torch.set_num_threads(threads)
    idx = torch.randint(0, 65, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    models, work, decision = {}, {}, None
    for variant in variants:
        models[variant] = build(
            "regional_inplace" if variant == GATED else variant, depth, width, device
        )

        def step(model=models[variant]) -> None:
            step_once(model, idx)
            model.zero_grad(set_to_none=True)

        for _ in range(protocol.WARMUP_STEPS + 1):  # the first one compiles
            step()
        if variant == GATED:
            decision = run_gate(models[variant], step, device)
        work[variant] = step
    load = protocol.OtherLoad()
    times = protocol.interleave(work, rounds, steps, clock=lambda: synchronize(device))
    estimates = {variant: protocol.estimate(rounds) for variant, rounds in times.items()}
    references = [r for r in ("whole", "accelerate") if r in times]
    versus = {
        reference: {v: protocol.paired_ratio(t, times[reference]) for v, t in times.items()}
        for reference in references
    }
    return {
        "variants": list(variants),
        "decision": decision,
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
        command += ["--variants", *args.variants]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"depth {depth}, {threads} thread(s) failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def table_lines(results: list[dict]) -> list[str]:
    """The table of steady steps and paired ratios, one row per (result, variant), each
    figure with its uncertainty; then the gate's decisions against its goal."""
    lines = [
        "| depth | threads | variant | steady step (ms) | +- | vs whole | +- | vs accelerate "
        "| +- |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        ms = result["ms"]

        def versus(reference: str, variant: str, result: dict = result) -> str:
            if reference not in result["ratio"]:
                return "- | -"
            value = result["ratio"][reference][variant]
            spread = result["ratio_uncertainty"][reference][variant]
            return f"{value:.3f}x | {100 * spread:.1f}%"

        for variant in result.get("variants", VARIANTS):
            lines.append(
                f"| {result['depth']} | {result['threads']} | {LABELS[variant]} | "
                f"{ms[variant]:.1f} | {100 * result['uncertainty'][variant]:.1f}% | "
                f"{versus('whole', variant)} | {versus('accelerate', variant)} |"
            )
    lines.append("")
    for result in results:
        ms = result["ms"]
        if result.get("decision") is None or not {"eager", "regional_inplace"} <= set(ms):
            continue
        best = min(ms["eager"], ms["regional_inplace"])
        ratio = ms[GATED] / best
        verdict = "met" if ratio <= GATED_GOAL else "NOT met"
        lines.append(
            f"- depth {result['depth']}, {result['threads']} thread(s): the gate decided "
            f'"{result["decision"]}"; after it, {ms[GATED]:.1f} ms a step, {ratio:.3f}x the '
            f"faster of eager and ours ({best:.1f} ms), goal {GATED_GOAL}x: {verdict}"
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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    if args.child:
        depth, threads = args.child
        variants = tuple(args.variants)
        result = child(depth, threads, args.width, args.rounds, args.steps, args.device, variants)
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
            ms = {v: round(t, 1) for v, t in results[-1]["ms"].items()}
            print(f"depth {depth} threads {threads}, ms: {ms}", flush=True)
    text = markdown(results, args)
    save_results(args.out, "steady_step", args.device, text, {"results": results})
    print(text)


if __name__ == "__main__":
    main()
