"""Compile caches that travel with a training run.

Two mechanisms, both torch's own:

- a cache directory that belongs to the run (``TORCHINDUCTOR_CACHE_DIR``; triton's cache
  lives under it on GPU), so a second run or a resume on the same disk starts warm;
- mega-cache artifacts (``torch.compiler.save_cache_artifacts`` /
  ``load_cache_artifacts``) stored in the checkpoint, so a resume on a fresh disk
  starts warm too. They are guarded by torch version, device type and compile options:
  on any difference they are ignored with one warning, never half-loaded.

Loading artifacts runs code: inductor unpickles their contents and writes files named
by their keys. So a checkpoint carries them signed (HMAC-SHA256 over the guard and the
bytes) with a key that belongs to the user (``artifact_key``), and only artifacts
signed with this user's key are loaded. Unsigned or foreign ones are ignored with one
warning (a cold start) unless the caller opts in. Even signed artifacts are checked,
without unpickling anything, for registered types and plain file-name keys.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager

CHECKPOINT_KEY = "lightning_regions_compile_cache"
#: The environment variable that holds the signing secret itself (clusters).
KEY_ENVIRONMENT_VARIABLE = "LIGHTNING_REGIONS_ARTIFACT_KEY"
KEY_FILE_NAME = "artifact_key"
#: What a torch cache key looks like: one file name, no separators, no parent.
SAFE_CACHE_KEY = re.compile(r"[A-Za-z0-9_\-.+=]+")


class CacheArtifactsIgnoredWarning(UserWarning):
    """Compile-cache artifacts in a checkpoint do not fit this run and were not loaded."""


class CacheArtifactsRefusedError(ValueError):
    """Artifacts that passed the signature check are not of a shape torch writes."""


def key_path() -> Path:
    """``$XDG_CONFIG_HOME/lightning_regions/artifact_key`` (default ``~/.config/...``)."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(config_home) / "lightning_regions" / KEY_FILE_NAME


def artifact_key() -> bytes:
    """This user's signing secret: ``$LIGHTNING_REGIONS_ARTIFACT_KEY``, else the key file,
    created on first use with mode 0600 (atomically, so parallel ranks agree)."""
    from_environment = os.environ.get(KEY_ENVIRONMENT_VARIABLE)
    if from_environment:
        return from_environment.encode()
    path = key_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".key-")
        try:
            os.fchmod(descriptor, 0o600)
            os.write(descriptor, secrets.token_hex(32).encode())
            os.close(descriptor)
            os.link(temporary, path)  # fails if another process made it first: use theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    return path.read_bytes().strip()


def sign(guard: dict[str, str], artifacts: bytes, key: bytes | None = None) -> str:
    """HMAC-SHA256 over the guard (canonical JSON) and the artifact bytes."""
    message = json.dumps(guard, sort_keys=True).encode() + b"\0" + artifacts
    return hmac.new(key or artifact_key(), message, hashlib.sha256).hexdigest()


def check_artifact_shapes(artifacts: bytes) -> Any:
    """Parse ``artifacts`` as torch does, without unpickling any content, and refuse
    unregistered types and keys that are not a plain file name. Returns torch's parse."""
    parsed = CacheArtifactManager.deserialize(artifacts)
    if parsed is None:
        raise CacheArtifactsRefusedError("Compile-cache artifacts are not in torch's format.")
    registered = set(CacheArtifactFactory._artifact_types)
    for artifact_type, entries in parsed.items():
        if artifact_type not in registered:
            raise CacheArtifactsRefusedError(
                f"Compile-cache artifact type {artifact_type!r} is not one torch registers "
                f"({sorted(registered)})."
            )
        for entry in entries:
            key = entry.key
            if (
                not isinstance(key, str)
                or not SAFE_CACHE_KEY.fullmatch(key)
                or ".." in key
                or os.path.isabs(key)
            ):
                raise CacheArtifactsRefusedError(
                    f"Compile-cache artifact key {key!r} ({artifact_type}) is not a plain file "
                    "name; it would be written outside the cache directory. Not loaded."
                )
    return parsed


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
    """This process's compile artifacts with their guard and signature, or None."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    artifacts, _info = saved
    return {"guard": guard, "artifacts": artifacts, "signature": sign(guard, artifacts)}


def unpack_artifacts(
    payload: dict[str, Any] | None, guard: dict[str, str], trust_unsigned: bool = False
) -> bool:
    """Load ``payload``'s artifacts if this user signed them and the guard equals
    ``guard``; otherwise warn once and load nothing (a cold start).

    ``trust_unsigned=True`` also loads unsigned and foreign artifacts: they run code.
    Signed or not, artifacts of a shape torch does not write raise
    ``CacheArtifactsRefusedError`` before torch sees them.
    """
    if not payload:
        return False
    artifacts, signature = payload.get("artifacts"), payload.get("signature")
    if not isinstance(artifacts, bytes):
        warnings.warn(
            "Compile-cache artifacts in the checkpoint are not bytes; ignored (cold start).",
            CacheArtifactsIgnoredWarning,
            stacklevel=2,
        )
        return False
    saved_guard = payload.get("guard", {})
    if not trust_unsigned:
        expected = sign(saved_guard, artifacts) if isinstance(saved_guard, dict) else ""
        if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
            why = "unsigned" if signature is None else "not signed with this user's key"
            warnings.warn(
                f"Compile-cache artifacts in the checkpoint are {why}, so they were not "
                f"loaded (cold start): loading them would run their code. Artifacts are "
                f"trusted when signed with {key_path()} or ${KEY_ENVIRONMENT_VARIABLE}; "
                "pass trust_unsigned_artifacts=True only for checkpoints you trust.",
                CacheArtifactsIgnoredWarning,
                stacklevel=2,
            )
            return False
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
    CacheArtifactManager.populate_caches(check_artifact_shapes(artifacts))
    return True
