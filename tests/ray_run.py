"""Ray Train's documented Lightning recipe on a local Ray cluster of 2 CPU workers, run as
a script: ``TorchTrainer``, ``ScalingConfig(num_workers=2, use_gpu=False)``,
``RayLightningEnvironment``, ``RayTrainReportCallback`` and ``prepare_trainer``, with
the strategy ``RayDDPStrategy`` ("plain"), ``regional_strategy(RayDDPStrategy)``
("regional") or the same with ``compile_in_background=True`` ("background").

Usage: python tests/ray_run.py OUT_DIR MODE [MODE ...]
One Ray cluster, one ``TorchTrainer``: its two workers run the modes in turn, each mode a
``Trainer`` of its own in the same worker processes (the first mode in fresh ones; each
worker group costs about 18 s to start here, and the process group is the job's, as in
any Ray Train function that fits more than once). Each worker writes
OUT_DIR/<mode>_rank<r>.pt (losses, final parameters, what compiled, its pid and its
children's). After ``ray.shutdown()`` the script writes OUT_DIR/left_running.pt: every
recorded process that still runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ray.train.torch import TorchTrainer

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

#: Steps of a run; the background mode stops 3 steps after its switch.
STEPS = {"plain": 4, "regional": 4, "background": 150, "plain_long": 150}


def train(config: dict) -> None:
    """What each Ray worker runs: each mode in turn, each from empty dynamo caches (as the
    suite's tests start: ``conftest.fresh_dynamo``), so its graph count is its own."""
    for mode in config["modes"]:
        torch._dynamo.reset()
        train_one(mode, Path(config["out"]))


def train_one(mode: str, out: Path) -> None:
    """The recipe, then what the test reads."""
    import lightning.pytorch as pl
    from helpers import WaitForTheSwitch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import TiedWeightsCheck, regional_strategy

    torch.manual_seed(0)
    data = CharDataModule(block_size=16, batch_size=4)
    model = GPTModule(
        vocab_size=data.vocab_size, block_size=16, n_layer=4, n_head=2, n_embd=16, unique_blocks=4
    )
    waiting = []
    if mode.startswith("plain"):
        strategy = RayDDPStrategy()
    else:
        background = mode == "background"
        strategy = regional_strategy(RayDDPStrategy)(
            backend="aot_eager", compile_in_background=background
        )
        waiting = [WaitForTheSwitch(0.5, after=3)] if background else []
    trainer = pl.Trainer(
        max_steps=STEPS[mode],
        accelerator="cpu",
        devices="auto",
        strategy=strategy,
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), TiedWeightsCheck(), *waiting],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(out / mode),
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, data)
    rank = trainer.global_rank
    blocks = model.model.blocks
    payload = {
        "losses": model.losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "compiled": [block._compiled_call_impl is not None for block in blocks],
        "pid": os.getpid(),
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
    }
    background = getattr(trainer.strategy, "background", None)
    if background is not None:
        payload["switched"] = background.switched and not background.failure
        payload["switch_step"] = waiting[0].switch_step
        payload["children"] = [child.pid for child in background.children]
    if hasattr(trainer.strategy, "reporter"):
        from lightning_regions import region_report

        report = region_report(model)
        payload["graphs"] = sum(row.graphs for row in report.rows)
    torch.save(payload, out / f"{mode}_rank{rank}.pt")


def main(out: Path, modes: list[str]) -> None:
    from helpers import is_running

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        train,
        train_loop_config={"modes": modes, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="modes", storage_path=str(out / "ray_results")),
    )
    trainer.fit()
    pids: list[int] = []
    for mode in modes:
        for rank in range(2):
            payload = torch.load(out / f"{mode}_rank{rank}.pt", weights_only=False)
            pids += [payload["pid"], *payload.get("children", [])]
    ray.shutdown()
    deadline = time.monotonic() + 30  # Ray stops its workers asynchronously
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    torch.save([pid for pid in pids if is_running(pid)], out / "left_running.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
