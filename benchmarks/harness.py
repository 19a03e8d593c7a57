"""What every benchmark shares: a quiet Trainer, provenance, and writing results.

- ``quiet_trainer``: a real Lightning ``Trainer`` that only trains what it is given, with
  no validation, logger, checkpoints, progress bar or model summary unless asked, its
  files in a fresh temporary folder (removed when the process exits).
- ``provenance``: the commit (``+dirty`` with uncommitted changes), the date, the
  machine and the command of a run.
- ``save_results``: ``name.md`` and ``name.json`` in ``benchmarks/results/``, each with
  that provenance (a last line of the Markdown, a ``provenance`` key of the JSON).
- ``in_child`` and ``ranks_in_child``: a script run again as its own child (``--child
  ...``) in a new process, from the repository root, often with an empty compile cache of
  its own; ``to_parent`` is the child's side. ``median_of``: one figure's median over
  runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _trainer_folders() -> tempfile.TemporaryDirectory[str]:
    """The folder that holds the quiet Trainers' folders, one per Trainer; made at the first
    Trainer (not at import: most benchmarks import this module for ``provenance`` alone),
    kept alive by the cache and removed when the process exits."""
    return tempfile.TemporaryDirectory(prefix="benchmark-")


def quiet_trainer(
    strategy: Any = "auto",
    *,
    steps: int = 2000,
    callbacks: Sequence[Any] = (),
    device: str = "cpu",
    devices: int = 1,
    **overrides: Any,
) -> Any:
    """A ``Trainer`` of ``steps`` optimizer steps on ``devices`` ``device``\\ s (``cpu``
    or ``cuda``) that trains and does nothing else; ``overrides`` are Trainer arguments
    (``limit_val_batches``, ``precision``, ``enable_checkpointing`` ...)."""
    import lightning.pytorch as pl

    options: dict[str, Any] = {
        "strategy": strategy,
        "accelerator": "gpu" if device == "cuda" else device,
        "devices": devices,
        "max_steps": steps,
        "limit_val_batches": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tempfile.mkdtemp(dir=_trainer_folders().name),
        "callbacks": list(callbacks),
    }
    return pl.Trainer(**{**options, **overrides})


def machine() -> str:
    """The processor, its cores, Python's and torch's versions."""
    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def commit() -> str:
    """This checkout's commit, ``+dirty`` when files differ from it; ``unknown`` outside
    git."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance(device: str = "cpu", command: str | None = None) -> dict[str, str]:
    """Where a result comes from: commit, date, machine, device and command."""
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "device": device,
        "command": command or " ".join(["python", *sys.argv]),
    }


def provenance_line(about: dict[str, str]) -> str:
    """``about`` (``provenance``) as one Markdown line."""
    return (
        f"Commit `{about['commit']}`, {about['date']}, {about['machine']}, device "
        f"{about['device']}; command `{about['command']}`."
    )


def save_results(out: Path, name: str, device: str, markdown: str, data: dict) -> Path:
    """Write ``name.md`` and ``name.json`` under ``out`` (``name_<device>`` off CPU), both
    with the run's provenance. Returns the path without its suffix, for any further file
    of the same run."""
    about = data.setdefault("provenance", provenance(device))
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (name if device == "cpu" else f"{name}_{device}")
    text = markdown.rstrip("\n") + "\n\n" + provenance_line(about) + "\n"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    return stem


class ChildFailed(RuntimeError):
    """A benchmark's child process exited with an error; the message ends with its
    standard error's last lines."""


@contextlib.contextmanager
def _child_env(env: Mapping[str, str] | None, fresh_cache: bool) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        made = dict(os.environ if env is None else env)
        if fresh_cache:
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="benchmark-cache-"))
            made["TORCHINDUCTOR_CACHE_DIR"] = cache
        yield made


def _run(command: list[str], env: dict[str, str], what: str) -> str:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ChildFailed(f"{what} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def in_child(
    script: str, *arguments: str, env: Mapping[str, str] | None = None, fresh_cache: bool = False
) -> Any:
    """Run ``python SCRIPT ARGUMENTS`` in a new process from the repository root (``env``:
    its environment, this one's by default; ``fresh_cache``: with an empty
    ``TORCHINDUCTOR_CACHE_DIR`` of its own, removed after) and return the JSON of the last
    line it printed (``to_parent``). Raises ``ChildFailed`` naming its standard error."""
    with _child_env(env, fresh_cache) as child_env:
        out = _run([sys.executable, script, *arguments], child_env, " ".join(arguments))
    return json.loads(out.strip().splitlines()[-1])


def ranks_in_child(
    script: str,
    *arguments: str,
    ranks: int,
    env: Mapping[str, str] | None = None,
    fresh_cache: bool = False,
) -> list[Any]:
    """``in_child`` for a script that starts ``ranks`` processes: each writes its figures
    to ``rank<r>.json`` in the folder passed as ``--child-out``; returned by rank."""
    with tempfile.TemporaryDirectory(prefix="benchmark-ranks-") as out:
        with _child_env(env, fresh_cache) as child_env:
            command = [sys.executable, script, *arguments, "--child-out", out]
            _run(command, child_env, " ".join(arguments))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]


def to_parent(result: Any) -> None:
    """The child's side of ``in_child``: its result, as the last line it prints."""
    print(json.dumps(result), flush=True)


def median_of(runs: Iterable[Mapping[str, Any]], key: str) -> float:
    """The median of ``key`` over ``runs``."""
    return float(statistics.median(run[key] for run in runs))
