"""The headline on a CUDA GPU, in one command: ``make gpu-check`` (or this script).

Runs with the GPU machine's own ``python3`` and the package from this source tree
(``PYTHONPATH=.``), nothing to install or download. In order, each start in its own
process with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (triton's cache lives under it):

1. cold first step and steady step of the tiny GPT (width 512, batch 8x128, forward and
   backward) at depth 4 and 16: eager, whole-model ``torch.compile``, accelerate's
   ``compile_regions`` (given the model without its alias, which it would drop), ours
   in place, ours with ``granularity="nested"`` and torch's ``nested_compile_region`` on
   the block class by hand (``benchmarks/compile_time.py --device cuda``), each with its
   first step's largest output and gradient error against eager;
2. the steady step of the same six at the deepest depth by the measurement protocol: all
   six in one process, warmed, timed in 30 rounds interleaved across them, the median of
   round medians and paired ratios with their uncertainty (``benchmarks/steady_step.py``,
   ``benchmarks/protocol.py``);
3. ``RegionalCompileStrategy`` with ``mode="reduce-overhead"`` (CUDA graphs) against the
   default mode: 20 steps each, steady step (``examples/resume_run.py``);
4. a warm resume from checkpoint artifacts into an empty cache directory, against cold.

Sizes are chosen to finish in about 7 minutes on one H200 (estimated; budget: 8). Writes
``gpu_check.json`` and ``gpu_check.md`` to ``--out`` and prints the ratios. Without a
GPU it says so and exits with status 2. ``--device cpu --depths 1 --width 32`` runs the
same steps on a CPU, small, to check the script itself before a GPU session.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
NO_GPU = 2
VARIANTS = ("eager", "whole", "accelerate", "regional_inplace", "nested", "torch_nested")
DEPTHS = (4, 16)
WIDTH = 512
RESUME_MODEL = ["--n-layer", "4", "--n-embd", "256", "--block-size", "64"]


def gpu_or_exit() -> str:
    """The GPU's name, or a clear message and exit status 2 (no traceback)."""
    try:
        import torch
    except ImportError:
        print(
            f"gpu-check: no GPU check here: {sys.executable} cannot import torch. "
            "On the GPU machine run `make gpu-check` with its own python3."
        )
        sys.exit(NO_GPU)
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU is present (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}). This check measures the headline on a GPU; "
            "run `make gpu-check` on a machine with one."
        )
        sys.exit(NO_GPU)
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"


def step(name: str, results: dict, run) -> None:
    """Run one part; a failure is recorded in one line and the other parts go on."""
    start = time.perf_counter()
    try:
        results[name] = run()
    except Exception as error:  # a broken part must not lose the others' figures
        results[name] = {"error": f"{type(error).__name__}: {str(error)[-500:]}"}
    print(f"[{time.perf_counter() - start:6.1f} s] {name}: {results[name]}", flush=True)


def cold_starts(device: str, depths: list[int], width: int) -> dict:
    from compile_time import run_isolated

    return {
        str(depth): {v: run_isolated(v, depth, width, device) for v in VARIANTS} for depth in depths
    }


def steady_steps(device: str, depths: list[int], width: int) -> dict:
    from steady_step import run_isolated

    settings = argparse.Namespace(width=width, rounds=30, steps=3, device=device)
    return {str(depth): run_isolated(depth, 1, settings) for depth in depths}


def modes(device: str) -> dict:
    from warm_start import accelerator, start

    out = {}
    for mode in ("default", "reduce-overhead"):
        with tempfile.TemporaryDirectory(prefix="gpu-mode-") as tmp:
            model = [*RESUME_MODEL, "--accelerator", accelerator(device), "--batches", "20"]
            model += [] if mode == "default" else ["--mode", mode]
            out[mode] = start(model, Path(tmp) / "run", Path(tmp) / "cache", 20, None)
    return out


def warm_resume(device: str) -> dict:
    from warm_start import accelerator, start

    with tempfile.TemporaryDirectory(prefix="gpu-warm-") as tmp:
        root, model = Path(tmp), [*RESUME_MODEL, "--accelerator", accelerator(device)]
        cold = start(model, root / "a", root / "cache", 2, None)
        artifacts = start(model, root / "b", root / "empty", 3, root / "a" / "last.ckpt")
    return {"cold": cold, "checkpoint_artifacts": artifacts}


def markdown(results: dict) -> str:
    lines = [f"GPU check on {results['machine']}.", ""]
    cold = results.get("cold_starts", {})
    if "error" in cold:
        lines.append(f"cold starts failed: {cold['error']}")
    else:
        lines += [
            "| depth | variant | first step (s) | vs whole | peak GPU (MB) | max gradient error |",
            "|---|---|---|---|---|---|",
        ]
        for depth, rows in cold.items():
            whole = rows["whole"]
            for variant, row in rows.items():
                lines.append(
                    f"| {depth} | {variant} | {row['first_step_s']:.1f} | "
                    f"{row['first_step_s'] / whole['first_step_s']:.2f}x | "
                    f"{row['peak_gpu_mb']:.0f} | {row['gradient_error']:.1e} |"
                )
    steady = results.get("steady_steps", {})
    if "error" in steady:
        lines.append(f"\nsteady steps failed: {steady['error']}")
    elif steady:
        from steady_step import table_lines

        lines += ["", *table_lines(list(steady.values()))]
    for name in ("modes", "warm_resume"):
        part = results.get(name, {})
        if "error" in part:
            lines.append(f"\n{name} failed: {part['error']}")
            continue
        lines.append(f"\n| {name} | first step (s) | steady step (ms) | fx graph hits / misses |")
        lines.append("|---|---|---|---|")
        for kind, row in part.items():
            steady = f"{row['steady_step_ms']:.2f}" if len(row["losses"]) > 2 else "-"
            lines.append(
                f"| {kind} | {row['first_step_s']:.1f} | {steady} | "
                f"{row['fxgraph_hit']} / {row['fxgraph_miss']} |"
            )
    return "\n".join(lines) + "\n"


def ratios(results: dict) -> list[str]:
    lines = []
    cold = results.get("cold_starts", {})
    for depth in results.get("depths", DEPTHS):
        rows = cold.get(str(depth), {})
        if {"whole", "regional_inplace", "accelerate"} <= set(rows):
            ours, whole = rows["regional_inplace"], rows["whole"]
            lines.append(
                f"depth {depth}: regional first step {ours['first_step_s']:.1f} s = "
                f"{whole['first_step_s'] / ours['first_step_s']:.1f}x faster than whole-model "
                f"({whole['first_step_s']:.1f} s), "
                f"{ours['first_step_s'] / rows['accelerate']['first_step_s']:.2f}x accelerate"
            )
        if {"whole", "nested", "torch_nested"} <= set(rows):
            nested, whole, torch_nested = rows["nested"], rows["whole"], rows["torch_nested"]
            lines.append(
                f"depth {depth}: nested first step {nested['first_step_s']:.1f} s = "
                f"{nested['first_step_s'] / whole['first_step_s']:.2f}x whole, "
                f"{nested['first_step_s'] / torch_nested['first_step_s']:.2f}x torch's nested by "
                f"hand; gradient error {nested['gradient_error']:.1e} (torch's by hand "
                f"{torch_nested['gradient_error']:.1e})"
            )
    for depth, result in results.get("steady_steps", {}).items():
        if depth == "error":
            continue
        whole, accelerate = result["ratio"]["whole"], result["ratio"]["accelerate"]
        within = result["ratio_uncertainty"]["whole"]["regional_inplace"]
        lines.append(
            f"depth {depth}: steady step, regions {whole['regional_inplace']:.3f}x whole "
            f"(+-{100 * within:.1f}%) and {accelerate['regional_inplace']:.3f}x accelerate, "
            f"nested {whole['nested']:.3f}x whole"
        )
    modes = results.get("modes", {})
    if "reduce-overhead" in modes and "default" in modes:
        ratio = modes["reduce-overhead"]["steady_step_ms"] / modes["default"]["steady_step_ms"]
        lines.append(f"reduce-overhead steady step: {ratio:.2f}x the default mode's")
    warm = results.get("warm_resume", {})
    if "cold" in warm and "checkpoint_artifacts" in warm:
        ratio = warm["checkpoint_artifacts"]["first_step_s"] / warm["cold"]["first_step_s"]
        lines.append(f"warm resume from checkpoint artifacts: {ratio:.2f}x cold")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--width", type=int, default=WIDTH)
    args = parser.parse_args()
    machine = gpu_or_exit() if args.device == "cuda" else f"{args.device} (script check)"
    results: dict = {"machine": machine, "depths": args.depths}
    started = time.perf_counter()
    step("cold_starts", results, lambda: cold_starts(args.device, args.depths, args.width))
    deepest = [max(args.depths)]
    step("steady_steps", results, lambda: steady_steps(args.device, deepest, args.width))
    step("modes", results, lambda: modes(args.device))
    step("warm_resume", results, lambda: warm_resume(args.device))
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_check" if args.device == "cuda" else f"gpu_check_{args.device}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (args.out / f"{name}.md").write_text(table)
    print(table)
    print("\n".join(ratios(results)))
    print(f"gpu-check took {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
