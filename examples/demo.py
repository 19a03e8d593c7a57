"""The main job: train the tiny GPT with RegionalCompileStrategy and the tie check, then
show what it saves, side by side with eager, whole-model torch.compile and accelerate.

The main run is ``lightning-regions fit --config configs/regional.yaml`` (inductor, one
CPU device, a cold cache), in this process with Lightning's progress bar; its report
comes first. The table's rows, ours included, train the same model on the same data,
each in its own process with a fresh inductor cache (``examples/demo_table.py``),
so that no row pays for a progress bar the others do not draw.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

from examples import demo_table  # noqa: E402
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
    hparams = {k: v for k, v in regional.model.hparams.items() if not k.startswith("_")}
    loads = demo_table.checkpoint_verdict(checkpoint, hparams)

    print("\nTraining the same model each way, each in a fresh process, then timing them warm...")
    data = regional.datamodule
    size = {k: regional.model.hparams[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
    size["batch_size"] = data.batch_size
    _, table = demo_table.build_table("inductor", size, regional.trainer.max_steps)

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
    decided = report.gate_outcome or "not decided"
    print(f"compiled or eager, timed on this run's own steps: {decided}")
    print(
        f"compile time: {report.compile_seconds:.1f} s in the backend for {report.graphs} "
        "graph(s): the eval graph (compiled during the sanity check) and the train graph"
    )
    print(f"checkpoint: {checkpoint} (loads strictly into the plain GPTModule: {loads})\n")
    print(table)


if __name__ == "__main__":
    main_job()
