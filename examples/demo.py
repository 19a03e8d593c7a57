"""The main job: train the tiny GPT with RegionalCompileStrategy and the tie check, then
show what it saves, side by side with eager, whole-model torch.compile and accelerate.

The main run is ``lightning-regions fit --config configs/regional.yaml`` (inductor, one
CPU device, a cold cache), in this process with Lightning's progress bar. The other
rows train the same model on the same data, each in its own quiet process with a fresh
inductor cache (``examples/demo_table.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

from examples.demo_table import format_table, measure, run_in_fresh_process  # noqa: E402
from examples.lightning_gpt import StepTimer  # noqa: E402
from lightning_regions import TiedWeightsCheck, region_report  # noqa: E402
from lightning_regions.cli import main  # noqa: E402

CONFIG = "configs/regional.yaml"


def callback(cli, kind):
    return next(c for c in cli.trainer.callbacks if isinstance(c, kind))


def main_job() -> None:
    shutil.rmtree("runs/demo", ignore_errors=True)  # a cold start every time
    regional = main(["fit", "--config", CONFIG])
    report = region_report(regional.model)
    check = callback(regional, TiedWeightsCheck)
    checkpoint = Path(regional.trainer.checkpoint_callback.last_model_path)
    ours = measure("lightning_regions", regional.model, callback(regional, StepTimer), checkpoint)

    print("\nTraining the same model the other ways, each in a fresh process (quiet)...")
    data = regional.datamodule
    size = {k: regional.model.hparams[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
    size["batch_size"] = data.batch_size
    steps = regional.trainer.max_steps
    others = [
        run_in_fresh_process(name, "inductor", size, steps)
        for name in ("eager", "torch.compile", "accelerate")
    ]

    print("\n==================== lightning_regions demo ====================")
    print(f"regions compiled: {len(report.rows)} distinct, {report.graphs} graph(s)")
    for row in report.rows:
        print(f"  {row.class_name} at {', '.join(row.paths)}: {row.compiled_calls} compiled calls")
    aliases = "; ".join(" = ".join(g) for g in report.alias_groups) or "none"
    ties = "; ".join(" = ".join(g) for g in report.tie_groups) or "none"
    print(f"aliases kept: {aliases}")
    print(f"ties kept: {ties}")
    verdict = "passed" if check.broken == [] else f"FAILED: {check.broken}"
    print(f"tie check: {verdict}")
    print(
        f"compile time: {report.compile_seconds:.1f} s in the backend for {report.graphs} "
        "graph(s): the eval graph (compiled during the sanity check) and the train graph"
    )
    print(f"checkpoint: {checkpoint}\n")
    print(format_table([others[0], others[1], others[2], ours]))


if __name__ == "__main__":
    main_job()
