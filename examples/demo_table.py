"""The demo's comparison: one row per way to train the same tiny GPT on the same data.

Each row runs in its own process (``python -m examples.demo_table --row NAME``) with a
fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, so compiled rows are comparable cold starts:
the wall time to the first step, and the CPU time it took (this process, inductor's
compile workers and the g++ they run), which another busy program hardly moves. A row
that fails (accelerate on the aliased model) reports its error in one line.

The steady step is measured by the benchmarks' protocol (``benchmarks/protocol.py``) in
one more process (``--steady``): each row's model, compiled again from the warm cache its
own run left, one intra-op thread, rounds interleaved across the rows, the median of the
round medians with its spread. A busy machine is named in the table, not hidden in it.

- ``eager``: plain Lightning.
- ``torch.compile``: torch's whole-model compile of the GPT, ``model.compile()`` (in
  place, so its keys stay plain; ``torch.compile(model).loss`` would run eager).
- ``accelerate``: ``accelerate.utils.compile_regions`` on the GPT as it is.
- ``lightning_regions``: ``RegionalCompileStrategy`` with the tie check.
- ``background``: ``RegionalCompileStrategy(compile_in_background=True)``: it trains from
  the first step with the regions eager while a child process compiles them, and runs
  until a few steps after its switch to compiled regions ("compiled from").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import protocol  # noqa: E402

ROWS = ("eager", "torch.compile", "accelerate", "lightning_regions", "background")
#: The background row runs at most this many steps, waiting for its switch.
BACKGROUND_STEP_CAP = 5000
#: The demo's model and data (configs/regional.yaml); tests pass smaller ones.
DEMO_SIZE = {"block_size": 64, "n_layer": 4, "n_head": 2, "n_embd": 64, "batch_size": 16}
#: The steady-step measurement: interleaved rounds of this many steps per row.
STEADY_ROUNDS, STEADY_STEPS = 21, 4


@dataclass
class Row:
    """What one way of training showed. ``error`` is set when it could not train."""

    name: str
    time_to_first_step_s: float | None = None
    first_step_cpu_s: float | None = None
    other_cores: float | None = None  # other programs' cores while this row compiled
    steady_step_ms: float | None = None
    steady_uncertainty: float | None = None  # relative, of the median
    ties_kept: bool | None = None
    aliases_kept: bool | None = None
    checkpoint_loads: str | None = None
    compiled_from_step: int | None = None  # the first step that ran compiled regions
    compiled_from_s: float | None = None  # its start, from the start of fit
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


def prepare(name: str, module: Any, backend: str) -> Any:
    """Compile ``module`` (a ``GPTModule``) as row ``name`` does; the Trainer strategy."""
    if name == "torch.compile":
        module.model.compile(backend=backend)
    elif name == "accelerate":
        from accelerate.utils import compile_regions

        module.model = compile_regions(module.model, backend=backend)
    elif name == "lightning_regions":
        from lightning_regions import RegionalCompileStrategy

        return RegionalCompileStrategy(backend=backend)  # torch's cache: the row's own
    elif name == "background":
        from lightning_regions import RegionalCompileStrategy

        return RegionalCompileStrategy(backend=backend, compile_in_background=True)
    return "auto"


def train_row(name: str, backend: str, size: dict, steps: int, root: Path) -> Row:
    """Train one row in this process, quietly."""
    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import TiedWeightsCheck

    data = CharDataModule(block_size=size["block_size"], batch_size=size["batch_size"])
    module = GPTModule(vocab_size=data.vocab_size, **model_size(size))
    clock = FirstStepClock(steps)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    try:
        strategy = prepare(name, module, backend)
        pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            max_steps=BACKGROUND_STEP_CAP if name == "background" else steps,
            check_val_every_n_epoch=4,
            limit_val_batches=4,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[clock, checkpoints, TiedWeightsCheck(on_failure="warn")],
        ).fit(module, data)
    except Exception as error:  # the row reports any failure in one line
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Row(name=name, error=f"{type(error).__name__}: {message}"[:110])
    gpt = module.model
    hparams = {k: v for k, v in module.hparams.items() if not k.startswith("_")}
    return Row(
        name=name,
        time_to_first_step_s=clock.wall_s,
        first_step_cpu_s=clock.cpu_s,
        other_cores=clock.other_cores,
        ties_kept=gpt.lm_head.weight is gpt.wte.weight,
        aliases_kept=getattr(gpt, "layers", None) is getattr(gpt, "blocks", None),
        checkpoint_loads=checkpoint_verdict(root / "last.ckpt", hparams),
        compiled_from_step=clock.compiled_from_step if name != "eager" else None,
        compiled_from_s=clock.compiled_from_s if name != "eager" else None,
    )


def model_size(size: dict) -> dict:
    return {k: v for k, v in size.items() if k != "batch_size"}


class FirstStepClock(pl.Callback):
    """From the start of ``fit`` to the end of the first training step (the sanity check
    and the eval graph it compiles included): wall and CPU seconds, and the cores other
    programs used meanwhile. Under ``compile_in_background``, also when the regions ran
    compiled first; it stops that run 3 steps later, after ``steps`` at least."""

    def __init__(self, steps: int = 1) -> None:
        self.steps = steps
        self.wall_s: float | None = None
        self.cpu_s: float | None = None
        self.other_cores: float | None = None
        self.compiled_from_step: int | None = 1
        self.compiled_from_s: float | None = None
        self.step_began = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self.step_began = time.perf_counter() - self.start

    def on_fit_start(self, *args: object) -> None:
        self.start = time.perf_counter()
        self.cpu, self.load = protocol.CpuClock(), protocol.OtherLoad()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if self.wall_s is None:
            self.wall_s = time.perf_counter() - self.start
            self.cpu_s = self.cpu.seconds()
            self.other_cores = self.load.cores()
            self.compiled_from_s = self.step_began
        background = getattr(trainer.strategy, "background", None)
        if background is None:
            return
        if not background.switched:
            self.compiled_from_step = None
        elif self.compiled_from_step is None:  # the switch came in this step's boundary
            self.compiled_from_step = trainer.global_step + 1
            self.compiled_from_s = time.perf_counter() - self.start
        elif trainer.global_step >= max(self.steps, self.compiled_from_step + 2):
            trainer.should_stop = True


def steady_steps(names: list[str], backend: str, size: dict, caches: dict[str, str]) -> dict:
    """The protocol's steady step of each row, in this process: each row's model compiled
    again from the warm cache of its own cold run, one intra-op thread, rounds
    interleaved; ``{name: {"ms", "spread"}}`` and the cores other programs used."""
    import torch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import compile_regions, end_observation
    from lightning_regions.cache import CompileCache

    torch.set_num_threads(1)
    data = CharDataModule(block_size=size["block_size"], batch_size=size["batch_size"])
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    steps = {}
    for name in names:
        torch.manual_seed(0)
        module = GPTModule(vocab_size=data.vocab_size, **model_size(size))
        if prepare(name, module, backend) != "auto":  # ours: what the strategy does
            compile_regions(module, inplace=True, root_is_called=False, backend=backend)
        optimizer = module.configure_optimizers()
        CompileCache(caches[name]).enter()  # its own run's warm cache

        def step(module: Any = module, optimizer: Any = optimizer) -> None:
            module.training_step(batch, 0).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(protocol.WARMUP_STEPS):  # compiles from the warm cache, then warms
            step()
        end_observation(module)  # as the strategy does after the first optimizer step
        steps[name] = step
    load = protocol.OtherLoad()
    times = protocol.interleave(steps, STEADY_ROUNDS, STEADY_STEPS, clock=lambda: None)
    estimates = {name: protocol.estimate(rounds) for name, rounds in times.items()}
    return {
        "rows": {
            name: {"ms": 1000 * e.value, "uncertainty": e.uncertainty}
            for name, e in estimates.items()
        },
        "other_cores": load.cores(),
        "threads": torch.get_num_threads(),
    }


def run_in_fresh_process(name: str, backend: str, size: dict, steps: int, cache: str) -> Row:
    """``train_row`` in a new process with the empty inductor cache ``cache``; its Row
    back as JSON."""
    with tempfile.TemporaryDirectory(prefix="demo-row-") as scratch:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        command = [sys.executable, "-m", "examples.demo_table", "--row", name]
        command += ["--backend", backend, "--steps", str(steps), "--size", json.dumps(size)]
        command += ["--root", scratch]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Row(name=name, error=f"row process failed: {last}"[:110])
        return Row(**json.loads(done.stdout.strip().splitlines()[-1]))


def measure_steady(rows: list[Row], backend: str, size: dict, caches: dict[str, str]) -> dict:
    """``steady_steps`` for the rows that trained, in a new process; its result, which
    the rows also get."""
    names = [row.name for row in rows if not row.error]
    command = [sys.executable, "-m", "examples.demo_table", "--steady", ",".join(names)]
    command += ["--backend", backend, "--size", json.dumps(size), "--caches", json.dumps(caches)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"steady-step process failed: {last}"[:200]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        measured = result["rows"].get(row.name)
        if measured:
            row.steady_step_ms, row.steady_uncertainty = measured["ms"], measured["uncertainty"]
    return result


def format_table(rows: list[Row], steady: dict | None = None) -> str:
    """One line per row; then how it was measured, and the saving against whole-model
    compile in wall and CPU time, with the disturbance named when there was one."""

    def yes_no(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "NO")

    header = (
        f"{'':18}{'first step*':>12}{'CPU time*':>11}{'compiled from':>20}{'steady step':>13}"
        f"{'ties kept':>11}{'aliases kept':>14}  checkpoint loads into plain module"
    )
    lines = [header]
    for row in rows:
        if row.error:
            lines.append(f"{row.name:18}failed: {row.error}")
            continue
        steady_ms = f"{row.steady_step_ms:>10.1f} ms" if row.steady_step_ms else f"{'-':>13}"
        compiled = "-"
        if row.compiled_from_step is not None and row.compiled_from_s is not None:
            compiled = f"step {row.compiled_from_step} ({row.compiled_from_s:.1f} s)"
        lines.append(
            f"{row.name:18}{row.time_to_first_step_s:>10.1f} s{row.first_step_cpu_s:>9.1f} s"
            f"{compiled:>20}{steady_ms}{yes_no(row.ties_kept):>11}{yes_no(row.aliases_kept):>14}"
            f"  {row.checkpoint_loads}"
        )
    lines.append("* from the start of fit to the end of the first training step, sanity check")
    lines.append("  (and the eval graph it compiles) included, in every row; CPU time counts")
    lines.append("  this process and its compile workers (background: and its child so far);")
    lines.append("  compiled from: the first step that ran compiled regions, and when it began")
    if steady and "rows" in steady:
        uncertainty = max(measured["uncertainty"] for measured in steady["rows"].values())
        lines.append(
            f"steady step: warm, {steady['threads']} intra-op thread, median of "
            f"{STEADY_ROUNDS} interleaved rounds of {STEADY_STEPS} steps (uncertain by up to "
            f"+-{100 * uncertainty:.1f}%)"
        )
    elif steady:
        lines.append(steady["error"])
    disturbed = protocol.disturbance(
        [row.other_cores for row in rows] + [(steady or {}).get("other_cores")],
        [row.steady_uncertainty for row in rows if row.steady_uncertainty is not None],
    )
    by_name = {row.name: row for row in rows if not row.error}
    ours, whole = by_name.get("lightning_regions"), by_name.get("torch.compile")
    if ours and whole and whole.time_to_first_step_s and whole.first_step_cpu_s:
        wall = ours.time_to_first_step_s / whole.time_to_first_step_s
        cpu = ours.first_step_cpu_s / whole.first_step_cpu_s
        condition = "on a busy machine (below)" if disturbed else "on a quiet machine"
        lines.append(
            f"saving, {condition}: lightning_regions reaches its first step in {wall:.2f}x "
            f"the time of whole-model torch.compile ({ours.time_to_first_step_s:.1f} s vs "
            f"{whole.time_to_first_step_s:.1f} s) and {cpu:.2f}x its CPU time"
        )
    background = by_name.get("background")
    if background and whole and whole.time_to_first_step_s and background.compiled_from_s:
        lines.append(
            f"background: the first step in {background.time_to_first_step_s:.1f} s "
            f"({background.time_to_first_step_s / whole.time_to_first_step_s:.2f}x whole-model "
            f"torch.compile's), training eager meanwhile; compiled regions from step "
            f"{background.compiled_from_step}, {background.compiled_from_s:.1f} s after fit began"
        )
    if disturbed:
        lines.append(
            f"DISTURBED MEASUREMENT ({disturbed}): these times and ratios are not what this "
            "machine gives when quiet; run make demo again without other work beside it"
        )
    return "\n".join(lines)


def build_table(
    backend: str = "inductor", size: dict | None = None, steps: int = 64, rows=ROWS
) -> tuple[list[Row], str]:
    """Run each row in its own fresh process, then the steady steps in one more; return
    the rows and the printed table."""
    size = size or DEMO_SIZE
    scratch = tempfile.mkdtemp(prefix="demo-caches-")
    try:
        caches = {name: os.path.join(scratch, f"row{i}") for i, name in enumerate(rows)}
        results = [run_in_fresh_process(name, backend, size, steps, caches[name]) for name in rows]
        steady = measure_steady(results, backend, size, caches)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results, format_table(results, steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=ROWS)
    parser.add_argument("--steady", help="comma-separated rows to time warm")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--size", default=json.dumps(DEMO_SIZE))
    parser.add_argument("--root")
    parser.add_argument("--caches", default="{}")
    args = parser.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_regions").setLevel(logging.ERROR)
    size = json.loads(args.size)
    if args.steady:
        names = args.steady.split(",")
        print(json.dumps(steady_steps(names, args.backend, size, json.loads(args.caches))))
        return
    row = train_row(args.row, args.backend, size, args.steps, Path(args.root))
    print(json.dumps(asdict(row)))


if __name__ == "__main__":
    main()
