"""Compile caches across runs: torch's own cache, and artifacts in checkpoints.

Two mechanisms, both torch's own:

- torch's compile cache on disk (``CompileCache``): by default exactly the one a plain
  ``torch.compile`` run uses (``$TORCHINDUCTOR_CACHE_DIR``, else torch's default), so a
  second run of the same model starts warm whatever its root, as under plain
  ``torch.compile``; or a folder the user names, shared by every run that names it;
- mega-cache artifacts (``torch.compiler.save_cache_artifacts`` /
  ``load_cache_artifacts``) stored in the checkpoint, so a resume on a fresh disk
  starts warm too. torch records an artifact for every graph the process compiles or
  loads from its cache (a hit is recorded too), so a run that found its graphs warm
  still carries them. They are guarded by torch version, device type and compile
  options: on any difference they are ignored with one warning, never half-loaded.

Loading artifacts runs code: inductor unpickles their contents and writes files named
by their keys. So a checkpoint carries them signed (HMAC-SHA256 over the guard and the
bytes) with a key that belongs to the user (``artifact_key``), and only artifacts
signed with this user's key are loaded. Unsigned or foreign ones are ignored with one
warning (a cold start) unless the caller opts in. Even signed artifacts are checked,
without unpickling anything, for registered types and for keys whose files land inside
the cache directory (``ARTIFACT_LANDING``, read from torch's populate code). Any refusal
is one warning and a cold start: it never stops a resume.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .compat import (
    CacheArtifactManager,
    clear_inductor_caches,
    default_inductor_cache_dir,
    inductor_cache_dir,
    isa_probe_sources,
    registered_artifact_types,
)

CHECKPOINT_KEY = "lightning_regions_compile_cache"
#: The environment variable that holds the signing secret itself (clusters).
KEY_ENVIRONMENT_VARIABLE = "LIGHTNING_REGIONS_ARTIFACT_KEY"
KEY_FILE_NAME = "artifact_key"


class CacheArtifactsIgnoredWarning(UserWarning):
    """Compile-cache artifacts in a checkpoint do not fit this run and were not loaded."""


class CacheArtifactsRefusedError(ValueError):
    """Artifacts of a type or key that torch would not write inside the cache directory."""


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


def sign(
    guard: dict[str, str],
    artifacts: bytes,
    key: bytes | None = None,
    kernels: dict[str, bytes] | None = None,
) -> str:
    """HMAC-SHA256 over the guard (canonical JSON), the artifact bytes and, where there
    are any, the kernel files (each path with its SHA-256)."""
    message = json.dumps(guard, sort_keys=True).encode() + b"\0" + artifacts
    if kernels:
        digests = sorted((path, hashlib.sha256(data).hexdigest()) for path, data in kernels.items())
        message += b"\0" + json.dumps(digests).encode()
    return hmac.new(key or artifact_key(), message, hashlib.sha256).hexdigest()


#: The C++ kernel libraries inductor builds on CPU, as paths under its cache directory
#: (``<2 characters>/c<hash>.so``, ``.main.so`` for a kernel with Python bindings).
#: torch's cache artifacts do not carry them: artifacts loaded on a fresh disk find
#: their graphs, but g++ builds every kernel again (``benchmarks/warm_start.py``).
#: So they travel beside the artifacts, signed with them.
KERNEL_FILE = re.compile(r"[a-z0-9]{2}/c[a-z0-9]+(\.[a-z]+)?\.so")


def loaded_kernel_files(cache_root: str) -> dict[str, bytes]:
    """The kernel libraries (``KERNEL_FILE``) this process has loaded from ``cache_root``,
    by their path relative to it, read from the process's memory map (``/proc/self/maps``);
    none where the system has no such file."""
    root = os.path.realpath(cache_root)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return {}
    found: dict[str, bytes] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if not path.startswith(root + os.sep):
            continue
        relative = os.path.relpath(path, root)
        if KERNEL_FILE.fullmatch(relative) and relative not in found:
            found[relative] = Path(path).read_bytes()
    return found


def isa_probe_files(cache_root: str) -> dict[str, bytes]:
    """The libraries of inductor's instruction-set probes in ``cache_root`` (named as
    kernels, beside a ``.cpp`` that is a probe's source), by relative path. Their names
    hash the compiler's version, the flags and torch's version, so a node with another
    compiler never finds them; a node that finds them skips g++ for each (12.6 s on this
    2-core CPU) and still runs torch's load check on them."""
    sources = isa_probe_sources()
    sizes = {len(source.encode()) for source in sources}  # so that kernels' go unread
    root = Path(cache_root)
    found: dict[str, bytes] = {}
    if not sources or not root.is_dir():
        return found
    for library in root.glob("*/c*.so"):
        relative = library.relative_to(root).as_posix()
        source = library.with_suffix(".cpp")
        if not KERNEL_FILE.fullmatch(relative) or not source.is_file():
            continue
        if source.stat().st_size in sizes and source.read_text() in sources:
            found[relative] = library.read_bytes()
    return found


def kernel_files_to_ship(cache_root: str) -> dict[str, bytes]:
    """What travels beside this process's compile artifacts: the kernel libraries it
    loaded and the instruction-set probes its cache holds."""
    return loaded_kernel_files(cache_root) | isa_probe_files(cache_root)


def kernel_landing(relative: object, cache_root: str) -> str:
    """Where kernel file ``relative`` goes under ``cache_root``; raises
    ``CacheArtifactsRefusedError`` for a name that is not a kernel's or that leaves it."""
    if not isinstance(relative, str) or not KERNEL_FILE.fullmatch(relative):
        raise CacheArtifactsRefusedError(
            f"Compile-cache kernel file {relative!r} is not named as inductor names its C++ "
            "kernels. Not loaded."
        )
    root = os.path.realpath(cache_root)
    landing = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, landing]) != root or landing == root:
        raise CacheArtifactsRefusedError(
            f"Compile-cache kernel file {relative!r} would be written to {landing}, outside "
            f"the cache directory {root}. Not loaded."
        )
    return landing


def write_kernel_files(kernels: dict[str, bytes], cache_root: str) -> None:
    """Write each kernel file where inductor looks for it, unless one is there already
    (atomically: a process loading it meanwhile never sees half a file). Every path is
    checked (``kernel_landing``) before anything is written."""
    landings = {kernel_landing(relative, cache_root): data for relative, data in kernels.items()}
    for landing, data in landings.items():
        if os.path.exists(landing):
            continue
        os.makedirs(os.path.dirname(landing), exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=os.path.dirname(landing), prefix=".kernel-")
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.chmod(temporary, 0o755)
        os.replace(temporary, landing)


#: Where torch's ``populate_cache`` writes each registered artifact type, as a path
#: relative to inductor's cache directory, given the artifact's key (read from torch
#: 2.11 to 2.15, the same in each; a test populates every registered type into a fresh
#: directory and checks it against this table). torch 2.13's inductor artifact also
#: unpickles its content to emit a triton bundle, one more reason only signed artifacts
#: are loaded:
#: - ``inductor``: ``InductorCacheArtifact`` -> ``FxGraphCache._write_to_local_cache``
#:   writes ``fxgraph/<key[1:3]>/<key>/<sha256>`` (``FxGraphCache._get_tmp_dir_for_key``);
#: - ``aot_autograd``: ``AOTAutogradCacheArtifact`` -> ``AOTAutogradCache._write_to_local_cache``
#:   writes ``aotautograd/<key>/<sha256>``;
#: - ``autotune``: ``AutotuneCacheArtifact.populate_cache`` writes ``<key>`` itself, and
#:   CUDA keys are ``<2 chars>/<hash>.best_config``: a sub-folder, not an escape;
#: - ``precompile``: ``PrecompileCacheArtifact`` -> ``DynamoCache._write_to_local_cache``
#:   writes ``dynamo/<key>/entry``;
#: - ``pgo``: ``PGOCacheArtifact`` -> ``pgo.write_local_impl`` writes
#:   ``dynamo/code_state_<key>.pkl`` with ``<>:"/\\|?*`` replaced by ``_``
#:   (``pgo.code_state_path``), plus ``.tmp`` and ``.lock`` beside it.
ARTIFACT_LANDING: dict[str, Callable[[str], str]] = {
    "inductor": lambda key: os.path.join("fxgraph", key[1:3], key, "entry"),
    "aot_autograd": lambda key: os.path.join("aotautograd", key, "entry"),
    "autotune": lambda key: key,
    "precompile": lambda key: os.path.join("dynamo", key, "entry"),
    "pgo": lambda key: os.path.join(
        "dynamo", re.sub(r'[<>:"/\\|?*]', "_", f"code_state_{key}.pkl")
    ),
}


def artifact_landing(artifact_type: str, key: object, cache_root: str) -> str:
    """The absolute path torch writes an artifact of ``artifact_type`` and ``key`` to,
    under ``cache_root``. Raises ``CacheArtifactsRefusedError`` when the type is unknown
    or the path leaves ``cache_root`` (absolute, ``..``, or through a symlink)."""
    if artifact_type not in ARTIFACT_LANDING:
        raise CacheArtifactsRefusedError(
            f"Compile-cache artifact type {artifact_type!r} is not one whose location "
            f"lightning_regions knows ({sorted(ARTIFACT_LANDING)}). Not loaded."
        )
    if not isinstance(key, str) or not key or "\0" in key or os.path.isabs(key):
        raise CacheArtifactsRefusedError(
            f"Compile-cache artifact key {key!r} ({artifact_type}) is not a relative path. "
            "Not loaded."
        )
    root = os.path.realpath(cache_root)
    landing = os.path.realpath(os.path.join(root, ARTIFACT_LANDING[artifact_type](key)))
    if os.path.commonpath([root, landing]) != root or landing == root:
        raise CacheArtifactsRefusedError(
            f"Compile-cache artifact key {key!r} ({artifact_type}) would be written to "
            f"{landing}, outside the cache directory {root}. Not loaded."
        )
    return landing


def check_artifacts(artifacts: bytes, cache_root: str) -> Any:
    """Parse ``artifacts`` as torch does, without unpickling any content, and refuse
    unregistered types and keys whose files would land outside ``cache_root``.
    Returns torch's parse."""
    parsed = CacheArtifactManager.deserialize(artifacts)
    if parsed is None:
        raise CacheArtifactsRefusedError("Compile-cache artifacts are not in torch's format.")
    registered = registered_artifact_types()
    for artifact_type, entries in parsed.items():
        if artifact_type not in registered:
            raise CacheArtifactsRefusedError(
                f"Compile-cache artifact type {artifact_type!r} is not one torch registers "
                f"({sorted(registered)})."
            )
        for entry in entries:
            artifact_landing(artifact_type, entry.key, cache_root)
    return parsed


def cache_dir_option(cache_dir: str | os.PathLike[str] | bool | None) -> str | None:
    """Check a strategy's ``cache_dir`` and return the folder it names, or None for
    torch's own cache. ``False`` is accepted as None; ``True`` (the per-root folders of
    earlier versions) is accepted as None with a ``DeprecationWarning``."""
    if cache_dir is None or cache_dir is False:
        return None
    if cache_dir is True:
        warnings.warn(
            "cache_dir=True no longer keeps a cache folder per root: regions compile into "
            "torch's own cache ($TORCHINDUCTOR_CACHE_DIR, else torch's default), which every "
            "run shares. Leave cache_dir out, or pass a path shared by the runs that name it.",
            DeprecationWarning,
            stacklevel=3,
        )
        return None
    if isinstance(cache_dir, (str, os.PathLike)) and os.fspath(cache_dir):
        return os.fspath(cache_dir)
    raise ValueError(
        f"cache_dir={cache_dir!r}: pass a folder path shared by the runs that name it, or "
        "leave it out (None) for torch's own compile cache."
    )


class CompileCache:
    """The compile cache a run writes to, entered at setup and left at teardown.

    ``directory=None`` is torch's own cache, exactly where a plain ``torch.compile`` run
    would write: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else torch's default. torch keys
    its FX-graph and AOTAutograd entries by the graph, so every run of the user shares
    them, whatever its root. A path points ``TORCHINDUCTOR_CACHE_DIR`` there while the run
    is set up (triton's cache lives under it on GPU), shared by every run that names it.

    Either way nothing is created: torch makes the folder when it first writes there, and
    folders that did not exist before the run and are still empty after it are removed
    (torch makes the folder before it has anything to write: ``torch.compile`` imports
    its bisector, which asks for the cache directory), so a run whose backend writes
    nothing leaves nothing.
    """

    def __init__(self, directory: str | None = None) -> None:
        self.chosen = directory
        self._entered = False
        self._previous: str | None = None
        self._folders_made: list[Path] = []

    @property
    def directory(self) -> str:
        """The folder torch writes this run's compile cache to."""
        if self._entered or self.chosen is None:
            return os.path.abspath(
                os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_inductor_cache_dir()
            )
        return os.path.abspath(self.chosen)

    def enter(self) -> None:
        """Point torch at the cache (once; later calls do nothing)."""
        if self._entered:
            return
        self._folders_made = missing_folders(self.directory)
        if self.chosen is not None:
            self._previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(self.chosen)
            clear_inductor_caches()  # drop paths torch memoised for the old directory
        self._entered = True

    def exit(self) -> None:
        """Give the user's ``TORCHINDUCTOR_CACHE_DIR`` back; remove the empty folders made."""
        if not self._entered:
            return
        if self.chosen is not None:
            if self._previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._previous
            clear_inductor_caches()
        remove_empty_folders(self._folders_made)
        self._entered = False


def missing_folders(directory: str | os.PathLike[str]) -> list[Path]:
    """``directory`` and those of its parents that do not exist, deepest first."""
    missing = []
    for folder in (Path(directory).absolute(), *Path(directory).absolute().parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove each of ``folders`` (deepest first) while it is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty, or already gone
            if folder.exists():
                return


def artifact_guard(device_type: str, compile_options: dict[str, Any]) -> dict[str, str]:
    """What must match for saved artifacts to be loaded."""
    options = {key: repr(value) for key, value in sorted(compile_options.items())}
    return {"torch": str(torch.__version__), "device_type": device_type, "options": repr(options)}


def pack_artifacts(guard: dict[str, str]) -> dict[str, Any] | None:
    """This process's compile artifacts and the kernel files it loaded, with their guard
    and signature, or None."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    return sign_artifacts(guard, saved[0], kernel_files_to_ship(inductor_cache_dir()))


def sign_artifacts(
    guard: dict[str, str], artifacts: bytes, kernels: dict[str, bytes] | None = None
) -> dict[str, Any]:
    """``artifacts`` (torch's serialized compile artifacts) and ``kernels`` (kernel files
    by path in the cache directory) with ``guard`` and this user's signature over all
    three: what ``unpack_artifacts`` loads."""
    signature = sign(guard, artifacts, kernels=kernels)
    payload = {"guard": guard, "artifacts": artifacts, "signature": signature}
    if kernels:
        payload["kernels"] = kernels
    return payload


def unpack_artifacts(
    payload: dict[str, Any] | None,
    guard: dict[str, str],
    trust_unsigned: bool = False,
    source: str = "the checkpoint",
) -> bool:
    """Load ``payload``'s artifacts (and kernel files) into inductor's cache directory if
    this user signed them, the guard equals ``guard`` and every file lands inside that
    directory.

    Anything else (not bytes, unsigned, foreign, another guard, an unknown type, a key
    that escapes, torch failing to populate) gives one ``CacheArtifactsIgnoredWarning``
    naming the cause and ``source`` and returns False: a cold start, never a stopped run.
    ``trust_unsigned=True`` also loads unsigned and foreign artifacts: they run code.
    """
    if not payload:
        return False
    artifacts, signature = payload.get("artifacts"), payload.get("signature")
    kernels = payload.get("kernels") or {}

    def ignored(cause: str) -> bool:
        return _ignored(cause, source)

    if not isinstance(artifacts, bytes):
        return ignored("they are not bytes")
    if not isinstance(kernels, dict) or not all(isinstance(v, bytes) for v in kernels.values()):
        return ignored("their kernel files are not bytes by path")
    saved_guard = payload.get("guard", {})
    if not trust_unsigned:
        expected = (
            sign(saved_guard, artifacts, kernels=kernels) if isinstance(saved_guard, dict) else ""
        )
        if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
            why = "unsigned" if signature is None else "not signed with this user's key"
            return ignored(
                f"they are {why}, and loading them would run their code. Artifacts are "
                f"trusted when signed with {key_path()} or ${KEY_ENVIRONMENT_VARIABLE}; "
                "pass trust_unsigned_artifacts=True only for checkpoints you trust"
            )
    differences = [
        f"{key}: saved {saved_guard.get(key)!r}, now {value!r}"
        for key, value in guard.items()
        if saved_guard.get(key) != value
    ]
    if differences:
        return ignored("; ".join(differences))
    root = inductor_cache_dir()  # TORCHINDUCTOR_CACHE_DIR
    try:
        parsed = check_artifacts(artifacts, root)
        for relative in kernels:
            kernel_landing(relative, root)
    except CacheArtifactsRefusedError as refused:
        return ignored(str(refused))  # checked whole first: nothing is half-loaded
    try:
        write_kernel_files(kernels, root)
        CacheArtifactManager.populate_caches(parsed)
    except Exception as error:
        return ignored(f"torch failed to populate its caches: {type(error).__name__}: {error}")
    return True


def _ignored(cause: str, source: str) -> bool:
    warnings.warn(
        f"Compile-cache artifacts from {source} were not loaded (cold start): {cause}.",
        CacheArtifactsIgnoredWarning,
        stacklevel=4,
    )
    return False
