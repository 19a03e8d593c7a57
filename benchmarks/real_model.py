"""Cold start on a real model: transformers' GPT-2 at 12 layers, trained as people write it.

``loss = model(input_ids=x, labels=x).loss``, config defaults (12 layers, ``use_cache=True``,
dropout, the 50257-token vocabulary) but a width of 256. Every (variant, repeat) runs in
its own process with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``: one cold
forward+backward step, 2 warm-up steps, the median of 5 timed steps. Medians over
repeats; ratios against whole-model ``torch.compile`` from the same run.

Variants: eager; whole-model ``torch.compile``; accelerate's ``compile_regions``; ours
(``compile_regions(inplace=True)``) with transformers' training cache on, as before
issue 19 ("ours_cache_on"); ours with the cache off in training as the strategies do
(``disable_kv_cache_unless_asked``) and per-instance ints symbolic ("ours").

    python benchmarks/real_model.py                       # 3 repeats
    python benchmarks/real_model.py --repeats 1 --variants whole ours

Writes ``real_model.json`` and ``real_model.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from compile_time import add_run_arguments
from harness import in_child, save_results, to_parent

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("eager", "whole", "accelerate", "ours_cache_on", "ours")
WARMUP_STEPS, TIMED_STEPS = 2, 5
LAYERS, WIDTH, HEADS, BATCH, TOKENS = 12, 256, 4, 4, 128


def build(variant: str, device: str):
    """GPT-2 for ``variant``: the model to call and the module whose regions we report."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from lightning_regions import compile_regions
    from lightning_regions.core.kv_cache import disable_kv_cache_unless_asked

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS)
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    if variant == "whole":
        return torch.compile(model)
    if variant == "accelerate":
        from accelerate.utils import compile_regions as accelerate_compile_regions

        return accelerate_compile_regions(model)
    if variant == "ours_cache_on":
        return compile_regions(model, inplace=True)
    if variant == "ours":
        disable_kv_cache_unless_asked(model)
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        return compile_regions(model, inplace=True)
    return model


def run_child(variant: str, device: str) -> dict:
    import torch

    from benchmarks.compile_time import synchronize

    model = build(variant, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (BATCH, TOKENS), generator=generator).to(device)
    seconds = []
    for _ in range(1 + WARMUP_STEPS + TIMED_STEPS):
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    eager_layers = None
    if variant.startswith("ours"):
        from lightning_regions import region_report

        eager_layers = len(region_report(model).never_ran_compiled)
    return {
        "first_step_s": seconds[0],
        "steady_step_ms": 1000 * statistics.median(seconds[1 + WARMUP_STEPS :]),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "eager_layers": eager_layers,
    }


def run_isolated(variant: str, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return in_child(__file__, "--child", variant, "--device", device, env=env, fresh_cache=True)


def table(summary: dict, variants: list[str]) -> str:
    whole = summary.get("whole")
    lines = [
        "| variant | first step (s) | vs whole | steady step (ms) | vs whole | graphs | "
        "layers eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        row = summary[variant]
        first = f"{row['first_step_s'] / whole['first_step_s']:.2f}x" if whole else ""
        steady = f"{row['steady_step_ms'] / whole['steady_step_ms']:.2f}x" if whole else ""
        eager = "" if row["eager_layers"] is None else f"{row['eager_layers']:.0f}"
        lines.append(
            f"| {variant} | {row['first_step_s']:.1f} | {first} | {row['steady_step_ms']:.0f} | "
            f"{steady} | {row['graphs']:.0f} | {eager} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, VARIANTS)
    args = parser.parse_args()
    if args.child:
        to_parent(run_child(args.child, args.device))
        return

    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants:  # interleaved, so drift hits every variant alike
            result = run_isolated(variant, args.device)
            runs[variant].append(result)
            print(f"repeat {repeat + 1} {variant:14s} {result}", flush=True)
    summary = {
        variant: {
            key: None if results[0][key] is None else statistics.median(r[key] for r in results)
            for key in results[0]
        }
        for variant, results in runs.items()
    }
    header = (
        f"GPT2LMHeadModel, {LAYERS} layers, width {WIDTH}, {HEADS} heads, config defaults "
        f"otherwise; batch {BATCH}x{TOKENS} tokens, forward+backward with labels; device "
        f"{args.device}. Medians of {args.repeats} run(s), each in its own process with a "
        "fresh inductor cache."
    )
    markdown = f"{header}\n\n{table(summary, args.variants)}\n"
    save_results(args.out, "real_model", args.device, markdown, {"runs": runs, "medians": summary})
    print(markdown)


if __name__ == "__main__":
    main()
