"""The demo's comparison: one row per way to train the same tiny GPT on the same data.

Each row runs in its own process (``python -m examples.demo_table --row NAME``) with a
fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, so compiled rows are comparable cold starts.
A row that fails (accelerate on the aliased model) reports its error in one line.

- ``eager``: plain Lightning.
- ``torch.compile``: torch's whole-model compile of the GPT, ``model.compile()`` (in
  place, so its keys stay plain; ``torch.compile(model).loss`` would run eager).
- ``accelerate``: ``accelerate.utils.compile_regions`` on the GPT as it is.
- ``lightning_regions``: ``RegionalCompileStrategy`` with the tie check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("eager", "torch.compile", "accelerate", "lightning_regions")
#: The demo's model and data (configs/regional.yaml); tests pass smaller ones.
DEMO_SIZE = {"block_size": 64, "n_layer": 4, "n_head": 2, "n_embd": 64, "batch_size": 16}


@dataclass
class Row:
    """What one way of training showed. ``error`` is set when it could not train."""

    name: str
    time_to_first_step_s: float | None = None
    steady_step_ms: float | None = None
    ties_kept: bool | None = None
    aliases_kept: bool | None = None
    checkpoint_loads: str | None = None
    error: str | None = None


def checkpoint_verdict(path: Path, hparams: dict) -> str:
    """Whether a checkpoint loads strictly (weights only) into the plain ``GPTModule``."""
    import torch

    from examples.lightning_gpt import GPTModule

    state = torch.load(path, weights_only=True)["state_dict"]
    try:
        GPTModule(**hparams).load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        return f"no ({first[:60]})"
    return "yes"


def measure(name: str, module, timer, checkpoint: Path) -> Row:
    """The row for a finished run: times, structure kept, checkpoint verdict."""
    gpt = module.model
    hparams = {k: v for k, v in module.hparams.items() if not k.startswith("_")}
    return Row(
        name=name,
        time_to_first_step_s=timer.time_to_first_step_seconds,
        steady_step_ms=timer.steady_step_ms,
        ties_kept=gpt.lm_head.weight is gpt.wte.weight,
        aliases_kept=getattr(gpt, "layers", None) is getattr(gpt, "blocks", None),
        checkpoint_loads=checkpoint_verdict(checkpoint, hparams),
    )


def train_row(name: str, backend: str, size: dict, steps: int, root: Path) -> Row:
    """Train one row in this process, quietly."""
    import lightning.pytorch as pl

    from examples.lightning_gpt import CharDataModule, GPTModule, StepTimer
    from lightning_regions import RegionalCompileStrategy, TiedWeightsCheck

    data = CharDataModule(block_size=size["block_size"], batch_size=size["batch_size"])
    model_size = {k: v for k, v in size.items() if k != "batch_size"}
    module = GPTModule(vocab_size=data.vocab_size, **model_size)
    strategy = "auto"
    if name == "torch.compile":
        module.model.compile(backend=backend)
    elif name == "accelerate":
        from accelerate.utils import compile_regions

        module.model = compile_regions(module.model, backend=backend)
    elif name == "lightning_regions":
        strategy = RegionalCompileStrategy(backend=backend, cache_dir=False)
    timer = StepTimer()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        check_val_every_n_epoch=4,
        limit_val_batches=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[timer, checkpoints, TiedWeightsCheck(on_failure="warn")],
    )
    try:
        trainer.fit(module, data)
    except Exception as error:  # the row reports any failure in one line
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Row(name=name, error=f"{type(error).__name__}: {message}"[:110])
    return measure(name, module, timer, root / "last.ckpt")


def run_in_fresh_process(name: str, backend: str, size: dict, steps: int) -> Row:
    """``train_row`` in a new process with a fresh inductor cache; its Row back as JSON."""
    with tempfile.TemporaryDirectory(prefix="demo-row-") as scratch:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
        command = [sys.executable, "-m", "examples.demo_table", "--row", name]
        command += ["--backend", backend, "--steps", str(steps), "--size", json.dumps(size)]
        command += ["--root", scratch]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Row(name=name, error=f"row process failed: {last}"[:110])
        return Row(**json.loads(done.stdout.strip().splitlines()[-1]))


def format_table(rows: list[Row]) -> str:
    """One line per row, then the saving against whole-model compile as a ratio."""

    def yes_no(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "NO")

    header = (
        f"{'':18}{'first step*':>12}{'steady step':>13}{'ties kept':>11}"
        f"{'aliases kept':>14}  checkpoint loads into plain module"
    )
    lines = [header]
    for row in rows:
        if row.error:
            lines.append(f"{row.name:18}failed: {row.error}")
            continue
        lines.append(
            f"{row.name:18}{row.time_to_first_step_s:>10.1f} s{row.steady_step_ms:>10.1f} ms"
            f"{yes_no(row.ties_kept):>11}{yes_no(row.aliases_kept):>14}  {row.checkpoint_loads}"
        )
    lines.append("* from the start of fit to the end of the first training step, sanity check")
    lines.append("  (and the eval graph it compiles) included, in every row")
    by_name = {row.name: row for row in rows if not row.error}
    ours, whole = by_name.get("lightning_regions"), by_name.get("torch.compile")
    if ours and whole and whole.time_to_first_step_s:
        ratio = ours.time_to_first_step_s / whole.time_to_first_step_s
        lines.append(
            f"saving: lightning_regions reaches its first step in {ratio:.2f}x the time of "
            f"whole-model torch.compile ({ours.time_to_first_step_s:.1f} s vs "
            f"{whole.time_to_first_step_s:.1f} s)"
        )
    return "\n".join(lines)


def build_table(
    backend: str = "inductor", size: dict | None = None, steps: int = 64, rows=ROWS
) -> tuple[list[Row], str]:
    """Run each row in its own fresh process; return the rows and the printed table."""
    results = [run_in_fresh_process(name, backend, size or DEMO_SIZE, steps) for name in rows]
    return results, format_table(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=ROWS, required=True)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--size", default=json.dumps(DEMO_SIZE))
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    row = train_row(args.row, args.backend, json.loads(args.size), args.steps, Path(args.root))
    print(json.dumps(asdict(row)))


if __name__ == "__main__":
    main()
