"""What every benchmark shares: a quiet Trainer, provenance, and writing results.

- ``quiet_trainer``: a real Lightning ``Trainer`` that only trains what it is given, with
  no validation, logger, checkpoints, progress bar or model summary unless asked, its
  files in a fresh temporary folder (removed when the process exits).
- ``provenance``: the commit (``+dirty`` with uncommitted changes), the date, the
  machine and the command of a run.
- ``save_results``: ``name.md`` and ``name.json`` in ``benchmarks/results/``, each with
  that provenance (a last line of the Markdown, a ``provenance`` key of the JSON).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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
