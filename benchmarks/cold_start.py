"""Cold first step (forward + backward) of the tiny GPT: whole-model compile vs in-place
regional compile vs eager, each in its own process with a fresh TORCHINDUCTOR_CACHE_DIR.

Usage: python benchmarks/cold_start.py [--depth 4] [--repeats 1]
This is the quick measurement behind issue 2's note; the full benchmark (depths,
accelerate, nested_compile_region, plots) is still to be written.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("eager", "whole", "accelerate", "regional_inplace")


def one_run(variant: str, depth: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from examples.tiny_gpt import GPTConfig, TinyGPT
    from lightning_regions import compile_regions, region_report

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, block_size=128, n_layer=depth, n_embd=128, n_head=4))
    if variant == "whole":
        model = torch.compile(model)
    elif variant == "accelerate":
        from accelerate.utils import compile_regions as accelerate_compile_regions

        del model._modules["layers"]  # accelerate drops aliases; keep forward working
        model.layers = list(model.blocks)
        model = accelerate_compile_regions(model)
    elif variant == "regional_inplace":
        compile_regions(model, inplace=True)
    idx = torch.randint(0, 65, (8, 128))
    steps = []
    for _ in range(6):
        start = time.perf_counter()
        # Through __call__: model.loss() on an OptimizedModule would run the eager original.
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        steps.append(time.perf_counter() - start)
    graphs = region_report(model).graphs if variant == "regional_inplace" else None
    return {"first_s": steps[0], "steady_ms": 1000 * statistics.median(steps[2:]), "graphs": graphs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.depth)))
        return
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
            out = (
                subprocess.run(
                    [sys.executable, __file__, "--child", variant, "--depth", str(args.depth)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            results[variant].append(json.loads(out))
    whole = statistics.median(r["first_s"] for r in results["whole"])
    print(f"depth {args.depth}, {args.repeats} run(s) each, medians:")
    for variant, runs in results.items():
        first = statistics.median(r["first_s"] for r in runs)
        steady = statistics.median(r["steady_ms"] for r in runs)
        print(
            f"  {variant:18} first step {first:7.1f} s ({first / whole:.2f}x whole)  "
            f"steady {steady:7.1f} ms  graphs {runs[0]['graphs']}"
        )


if __name__ == "__main__":
    main()
