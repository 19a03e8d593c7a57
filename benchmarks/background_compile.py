"""The first step at eager speed: ``compile_in_background=True`` against the other ways of
compiling, on the demo GPT and the depth-16 GPT, cold.

For each way, Lightning trains the GPT in a fresh process with a fresh, empty
``TORCHINDUCTOR_CACHE_DIR`` (inductor on this machine's device):

- ``eager``: plain Lightning;
- ``torch.compile``: the GPT compiled whole (``model.compile()``);
- ``accelerate``: ``accelerate.utils.compile_regions`` (its ``layers`` alias, which
  accelerate drops, replaced by a plain list);
- ``lightning_regions``: ``RegionalCompileStrategy()``, the default mode;
- ``background``: ``RegionalCompileStrategy(compile_in_background=True)``, run until 10
  steps after its switch (at least ``--steps``).

Each run records the wall time from the start of ``fit`` to the end of every step: the
first step, step 10 and step 100 are read from it; the switch stall is the background
run's step in which the regions compiled in place, less the median of its eager steps.
Rounds are interleaved (each round runs every way, in a rotating order); figures are
medians over rounds (``protocol.py``); other programs' load is named.

    python benchmarks/background_compile.py [--rounds 3] [--models demo depth16]

Writes ``background_compile.{json,md}`` to ``--out``.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compile_time import save_results  # noqa: E402
from benchmarks.repeated_runs import warm_torchs_own_files  # noqa: E402

VARIANTS = ("eager", "torch.compile", "accelerate", "lightning_regions", "background")
MODELS = {
    # the demo (configs/regional.yaml)
    "demo": {"size": {"block_size": 64, "n_layer": 4, "n_head": 2, "n_embd": 64}, "batch": 16},
    # the benchmarks' depth-16 GPT (compile_time.py)
    "depth16": {"size": {"block_size": 128, "n_layer": 16, "n_head": 4, "n_embd": 256}, "batch": 8},
}
MARKS = (1, 10, 100)
AFTER_SWITCH = 10


def train(variant: str, model: str, steps: int, device: str) -> dict[str, Any]:
    """One run in this process: the end of every step, in seconds from the start of fit."""
    import lightning.pytorch as pl
    import torch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy

    spec = MODELS[model]
    data = CharDataModule(block_size=spec["size"]["block_size"], batch_size=spec["batch"])
    module = GPTModule(vocab_size=data.vocab_size, **spec["size"])
    strategy: Any = "auto"
    if variant == "torch.compile":
        module.model.compile()
    elif variant == "accelerate":
        from accelerate.utils import compile_regions

        gpt = module.model
        del gpt._modules["layers"]
        gpt.layers = list(gpt.blocks)
        module.model = compile_regions(gpt)
    elif variant == "lightning_regions":
        strategy = RegionalCompileStrategy()
    elif variant == "background":
        strategy = RegionalCompileStrategy(compile_in_background=True)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_fit_start(self, *args: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self.ends.append(time.perf_counter() - self.start)
            background = getattr(trainer.strategy, "background", None)
            if len(self.ends) < steps:
                return
            if background is None or (
                background.switched and len(self.ends) >= background.steps_eager + AFTER_SWITCH
            ):
                trainer.should_stop = True

    clock = Clock()
    pl.Trainer(
        strategy=strategy,
        accelerator=device,
        devices=1,
        max_steps=100_000,
        max_epochs=-1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="background-bench-"),
        callbacks=[clock],
    ).fit(module, data)
    record: dict[str, Any] = {"ends": clock.ends}
    background = getattr(strategy, "background", None)
    if background is not None:
        record["steps_eager"] = background.steps_eager
        record["failure"] = background.failure
        record["child_seconds"] = background.child_seconds
    counters = torch._dynamo.utils.counters
    record["fxgraph_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    record["fxgraph_miss"] = counters["inductor"]["fxgraph_cache_miss"]
    return record


def run_fresh(variant: str, model: str, steps: int, device: str, cache: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    command = [sys.executable, __file__, "--child", variant, "--models", model]
    command += ["--steps", str(steps), "--device", device]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(record: dict[str, Any]) -> dict[str, float | None]:
    """First step, step N, and for the background run the switch stall."""
    if "error" in record:
        return {}
    ends = record["ends"]
    out: dict[str, float | None] = {f"step_{n}": ends[n - 1] for n in MARKS if len(ends) >= n}
    if "steps_eager" in record:
        switched = record["steps_eager"]  # steps 1..k eager; step k+1 compiles in place
        durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
        eager = statistics.median(durations[1:switched]) if switched > 1 else durations[0]
        if len(durations) > switched:
            out["stall"] = durations[switched] - eager
            out["switch_step"] = float(switched + 1)
            out["switch_at_s"] = ends[switched - 1]
    return out


def table(model: str, rounds: list[dict[str, dict]]) -> str:
    def median(variant: str, key: str) -> float | None:
        values = [figures(r[variant]).get(key) for r in rounds]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        f"### {model}",
        "",
        "| variant | first step s | to step 10 s | to step 100 s | switch stall s | switched at |",
        "|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        errors = [r[variant]["error"] for r in rounds if "error" in r[variant]]
        if errors:
            lines.append(f"| {variant} | failed: {errors[0][:80]} | | | | |")
            continue
        switch = median(variant, "switch_step")
        at = median(variant, "switch_at_s")
        where = f"step {switch:.0f} ({at:.1f} s)" if switch is not None and at is not None else "-"
        lines.append(
            f"| {variant} | {cell(median(variant, 'step_1'))} | {cell(median(variant, 'step_10'))}"
            f" | {cell(median(variant, 'step_100'))} | {cell(median(variant, 'stall'))} | {where} |"
        )
    eager, ours = median("eager", "step_1"), median("lightning_regions", "step_1")
    first, stall = median("background", "step_1"), median("background", "stall")
    if None not in (eager, ours, first, stall):
        assert eager is not None and ours is not None and first is not None and stall is not None
        lines += [
            "",
            f"- background first step {first:.2f} s against 1.5 x eager's first step + 1 s = "
            f"{1.5 * eager + 1:.2f} s: {'met' if first <= 1.5 * eager + 1 else 'NOT met'}",
            f"- switch stall {stall:.2f} s against 0.25 x our default mode's cold first step = "
            f"{0.25 * ours:.2f} s: {'met' if stall <= 0.25 * ours else 'NOT met'}",
        ]
        sooner = [
            n
            for n in MARKS
            if (b := median("background", f"step_{n}")) is not None
            and (d := median("lightning_regions", f"step_{n}")) is not None
            and b < d
        ]
        lines.append(f"- background reaches step N sooner than the default mode for N in {sooner}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(train(args.child, args.models[0], args.steps, args.device)))
        return
    from benchmarks import protocol

    warm_torchs_own_files()
    load = protocol.OtherLoad()
    results: dict[str, list[dict[str, dict]]] = {model: [] for model in args.models}
    for index in range(args.rounds):
        order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
        for model in args.models:
            runs = {}
            with tempfile.TemporaryDirectory(prefix="background-bench-") as tmp:
                for variant in order:
                    cache = os.path.join(tmp, f"cache-{variant}")
                    runs[variant] = run_fresh(variant, model, args.steps, args.device, cache)
            results[model].append(runs)
    busy = load.cores()
    import torch

    markdown = (
        f"GPT cold starts, inductor on {args.device}, each run in a fresh process with a fresh "
        f"TORCHINDUCTOR_CACHE_DIR; medians of {args.rounds} interleaved round(s); torch "
        f"{torch.__version__}, {os.cpu_count()} cores; other programs used "
        f"{busy if busy is None else round(busy, 2)} cores on average.\n\n"
        + "\n".join(table(model, results[model]) for model in args.models)
    )
    save_results(args.out, "background_compile", args.device, markdown, {"results": results})
    print(markdown)


if __name__ == "__main__":
    main()
