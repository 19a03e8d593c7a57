"""The main job: train the tiny GPT with RegionalCompileStrategy and the tie check.

Runs ``lightning-regions fit --config configs/regional.yaml`` (inductor, one CPU
device), then the same config eagerly, and prints a short report.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.lightning_gpt import GPTModule, StepTimer  # noqa: E402
from lightning_regions import TiedWeightsCheck, region_report  # noqa: E402
from lightning_regions.cli import main  # noqa: E402

CONFIG = "configs/regional.yaml"


def callback(cli, kind):
    return next(c for c in cli.trainer.callbacks if isinstance(c, kind))


def fit(*overrides: str):
    return main(["fit", "--config", CONFIG, *overrides])


def main_job() -> None:
    # A cold start every time: the strategy keeps its compile cache in runs/demo.
    for old in ("runs/demo", "runs/demo-eager"):
        shutil.rmtree(old, ignore_errors=True)
    regional = fit()
    eager = fit("--trainer.strategy=auto", "--trainer.default_root_dir=runs/demo-eager")

    report = region_report(regional.model)
    check = callback(regional, TiedWeightsCheck)
    timer, eager_timer = callback(regional, StepTimer), callback(eager, StepTimer)
    checkpoint = Path(regional.trainer.checkpoint_callback.last_model_path)
    plain = GPTModule(**{k: v for k, v in regional.model.hparams.items() if k[0] != "_"})
    plain.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"], strict=True)

    def perplexity(cli) -> float:
        return float(cli.trainer.callback_metrics["val_perplexity"])

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
    print(f"{'':12}{'first train step':>22}{'steady step':>14}{'val perplexity':>16}")
    for name, cli, t in (("regional", regional, timer), ("eager", eager, eager_timer)):
        print(
            f"{name:12}{t.first_step_seconds:>20.1f} s{t.steady_step_ms:>11.1f} ms"
            f"{perplexity(cli):>16.2f}"
        )
    print(f"checkpoint: {checkpoint} (loads strictly into the plain GPTModule)")


if __name__ == "__main__":
    main_job()
