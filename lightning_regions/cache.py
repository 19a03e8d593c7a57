"""Compile caches that travel with a training run.

Two mechanisms, both torch's own:

- a cache directory that belongs to the run (``TORCHINDUCTOR_CACHE_DIR``; triton's cache
  lives under it on GPU), so a second run or a resume on the same disk starts warm;
- mega-cache artifacts (``torch.compiler.save_cache_artifacts`` /
  ``load_cache_artifacts``) stored in the checkpoint, so a resume on a fresh disk
  starts warm too. They are guarded by torch version, device type and compile options:
  on any difference they are ignored with one warning, never half-loaded.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_KEY = "lightning_regions_compile_cache"


class CacheArtifactsIgnoredWarning(UserWarning):
    """Compile-cache artifacts in a checkpoint do not fit this run and were not loaded."""


def use_cache_dir(directory: str | os.PathLike[str]) -> str | None:
    """Point inductor (and triton, below it) at ``directory``; return the previous value."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    Path(directory).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(directory).resolve())
    torch._inductor.utils.clear_caches()  # drop paths torch memoised for the old directory
    return previous


def restore_cache_dir(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    torch._inductor.utils.clear_caches()


def artifact_guard(device_type: str, compile_options: dict[str, Any]) -> dict[str, str]:
    """What must match for saved artifacts to be loaded."""
    options = {key: repr(value) for key, value in sorted(compile_options.items())}
    return {"torch": str(torch.__version__), "device_type": device_type, "options": repr(options)}


def pack_artifacts(guard: dict[str, str]) -> dict[str, Any] | None:
    """This process's compile artifacts with their guard, or None when there are none."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    artifacts, _info = saved
    return {"guard": guard, "artifacts": artifacts}


def unpack_artifacts(payload: dict[str, Any] | None, guard: dict[str, str]) -> bool:
    """Load ``payload``'s artifacts if its guard equals ``guard``; warn once if not."""
    if not payload:
        return False
    saved_guard = payload.get("guard", {})
    differences = [
        f"{key}: saved {saved_guard.get(key)!r}, now {value!r}"
        for key, value in guard.items()
        if saved_guard.get(key) != value
    ]
    if differences:
        warnings.warn(
            "Compile-cache artifacts in the checkpoint were ignored (cold start): "
            + "; ".join(differences),
            CacheArtifactsIgnoredWarning,
            stacklevel=2,
        )
        return False
    torch.compiler.load_cache_artifacts(payload["artifacts"])
    return True
