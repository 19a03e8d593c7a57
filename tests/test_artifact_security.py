"""A checkpoint stays data: compile artifacts from elsewhere never run code or write
outside the cache directory, and the user's own artifacts still give a warm start."""

from __future__ import annotations

import os
import pickle
import stat
import types
import warnings
from pathlib import Path

import pytest
import torch
from helpers import data, gpt, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager
from torch.utils._appending_byte_serializer import AppendingByteSerializer

from examples.lightning_gpt import GPTModule
from lightning_regions import RegionalCompileStrategy
from lightning_regions.cache import (
    ARTIFACT_LANDING,
    CHECKPOINT_KEY,
    KEY_ENVIRONMENT_VARIABLE,
    CacheArtifactsIgnoredWarning,
    CacheArtifactsRefusedError,
    artifact_guard,
    artifact_key,
    artifact_landing,
    key_path,
    sign,
    unpack_artifacts,
)
from lightning_regions.compat import clear_inductor_caches, registered_artifact_types


class MakesADirectory:
    """A pickle that runs code when loaded: it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def malicious_artifacts(marker: Path, outside: Path) -> bytes:
    """torch-serialised artifacts: a code-running pickle under an absolute-path key."""
    from torch.compiler._cache import _serialize_single_cache

    CacheArtifactManager._ensure_cache_artifacts_registered()
    artifact = CacheArtifactFactory.create(
        "inductor", str(outside / "fxgraph"), pickle.dumps(MakesADirectory(marker))
    )
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([("inductor", [artifact])])
    return serializer.to_bytes()


def guard() -> dict[str, str]:
    strategy = RegionalCompileStrategy(backend="eager")
    return artifact_guard("cpu", strategy.compile_kwargs)


def test_the_key_file_is_private_and_the_environment_overrides_it(monkeypatch):
    key = artifact_key()
    assert stat.S_IMODE(key_path().stat().st_mode) == 0o600
    assert artifact_key() == key and len(key) == 64
    monkeypatch.setenv(KEY_ENVIRONMENT_VARIABLE, "cluster-secret")
    assert artifact_key() == b"cluster-secret"
    assert sign({"a": "b"}, b"x") != sign({"a": "b"}, b"x", key=key)


def write_checkpoint(tmp_path: Path) -> Path:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "run", save_last=True)
    strategy = RegionalCompileStrategy(backend="eager")
    trainer(tmp_path, strategy, 2, [checkpoint]).fit(gpt(), data())
    return tmp_path / "run" / "last.ckpt"


def tamper(path: Path, artifacts: bytes, signature: str | None) -> None:
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY] = {"guard": guard(), "artifacts": artifacts}
    if signature is not None:
        checkpoint[CHECKPOINT_KEY]["signature"] = signature
    torch.save(checkpoint, path)


@pytest.mark.parametrize("whose", ["same_user", "another_user"])
@pytest.mark.parametrize("signature", ["kept", "missing"])
def test_a_tampered_checkpoint_runs_no_code_writes_nothing_and_trains_on(
    tmp_path, monkeypatch, whose, signature
):
    path = write_checkpoint(tmp_path)
    marker, outside = tmp_path / "marker", tmp_path / "outside"
    genuine_signature = sign(guard(), b"genuine artifacts")  # what the owner's run wrote
    kept = genuine_signature if signature == "kept" else None
    tamper(path, malicious_artifacts(marker, outside), kept)
    if whose == "another_user":
        monkeypatch.setenv(KEY_ENVIRONMENT_VARIABLE, "someone else's key")
    torch.load(path, weights_only=True)  # everything we add is still plain data
    resumed = gpt()
    strategy = RegionalCompileStrategy(backend="eager")
    with pytest.warns(CacheArtifactsIgnoredWarning, match="would run their code"):
        trainer(tmp_path, strategy, 4).fit(resumed, data(), ckpt_path=path)
    assert not marker.exists() and not outside.exists()
    assert len(resumed.losses) == 2  # resumed at step 2, trained on to step 4


def signed(artifacts: bytes) -> dict:
    return {"guard": guard(), "artifacts": artifacts, "signature": sign(guard(), artifacts)}


def test_signed_artifacts_that_would_land_outside_the_cache_are_refused_with_a_warning(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    marker, outside = tmp_path / "marker", tmp_path / "outside"
    artifacts = malicious_artifacts(marker, outside)
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not a relative path") as seen:
        assert unpack_artifacts(signed(artifacts), guard()) is False
    assert len(seen) == 1
    trusted = {"guard": guard(), "artifacts": artifacts}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not a relative path"):
        assert unpack_artifacts(trusted, guard(), trust_unsigned=True) is False
    assert not marker.exists() and not outside.exists()


AUTOTUNE_KEY = "4l/35f7aa22c0ffee.best_config"  # the shape of inductor's CUDA autotune keys


def one_artifact(artifact_type: str, key: str, content: object) -> bytes:
    """torch-serialised artifacts holding one artifact, as ``save_cache_artifacts`` writes."""
    from torch.compiler._cache import _serialize_single_cache

    CacheArtifactManager._ensure_cache_artifacts_registered()
    artifact = CacheArtifactFactory.encode_create(artifact_type, key, content)
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([(artifact_type, [artifact])])
    return serializer.to_bytes()


@pytest.mark.parametrize(
    ("artifact_type", "key", "lands_at"),
    [
        ("autotune", AUTOTUNE_KEY, AUTOTUNE_KEY),
        ("autotune", "plain.best_config", "plain.best_config"),
        ("inductor", "fabcdef", "fxgraph/ab/fabcdef/entry"),
        ("aot_autograd", "aabcdef", "aotautograd/aabcdef/entry"),
        ("precompile", "source_id", "dynamo/source_id/entry"),
        ("pgo", "mast:job/1", "dynamo/code_state_mast_job_1.pkl"),  # torch replaces / and :
    ],
)
def test_torch_s_own_layouts_land_inside_the_cache_directory(
    tmp_path, artifact_type, key, lands_at
):
    landing = artifact_landing(artifact_type, key, str(tmp_path))
    assert landing == str((tmp_path / lands_at).resolve())


#: A key of each registered type, as torch makes them.
SAMPLE_KEYS = {
    "inductor": "fabcdef",
    "aot_autograd": "aabcdef",
    "autotune": AUTOTUNE_KEY,
    "precompile": "source_id",
    "pgo": "mast:job/1",
}


def test_every_type_this_torch_registers_lands_where_the_table_says(tmp_path, monkeypatch):
    """Asks torch itself: each registered type's ``populate_cache`` writes into a fresh
    cache directory, and every file must lie where ``ARTIFACT_LANDING`` says (the file
    itself, or beside it: torch names the entry by a hash, PGO adds .tmp and .lock).
    A torch that adds a type, or moves one, fails here before it meets a user's resume."""
    registered = registered_artifact_types()
    assert registered == set(ARTIFACT_LANDING), (
        f"torch {torch.__version__} registers {sorted(registered)}; cache.ARTIFACT_LANDING "
        f"knows {sorted(ARTIFACT_LANDING)}: read the new type's populate_cache and add it"
    )
    for artifact_type in sorted(registered):
        root = tmp_path / artifact_type
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
        clear_inductor_caches()
        key = SAMPLE_KEYS[artifact_type]
        # torch 2.13's inductor artifact unpickles its content to emit a triton bundle
        content = pickle.dumps(types.SimpleNamespace(_triton_bundle=None))
        artifact = CacheArtifactFactory.create(artifact_type, key, content)
        with torch._dynamo.config.patch(automatic_dynamic_local_pgo=True):
            artifact.populate_cache()
        landing = Path(artifact_landing(artifact_type, key, str(root)))
        written = [path for path in root.rglob("*") if path.is_file()]
        assert written, artifact_type
        for path in written:
            assert path == landing or path.parent == landing.parent, (artifact_type, path)
    clear_inductor_caches()


@pytest.mark.parametrize(
    ("artifact_type", "key"),
    [
        ("autotune", "../outside.best_config"),
        ("autotune", "4l/../../outside.best_config"),
        ("autotune", "/etc/outside.best_config"),
        ("autotune", ""),
        ("autotune", "."),
        ("inductor", "x../../../../outside"),
        ("aot_autograd", "../../outside"),
        ("precompile", "../../outside"),
        ("unknown_type", "plain"),
    ],
)
def test_keys_that_escape_or_types_we_cannot_place_are_refused(tmp_path, artifact_type, key):
    with pytest.raises(CacheArtifactsRefusedError):
        artifact_landing(artifact_type, key, str(tmp_path / "cache"))


def test_a_symlink_inside_the_cache_directory_does_not_lead_outside(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache" / "4l").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheArtifactsRefusedError, match="outside the cache directory"):
        artifact_landing("autotune", AUTOTUNE_KEY, str(tmp_path / "cache"))


def test_torch_failing_to_populate_is_one_warning_and_a_cold_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    # torch's PGO artifact refuses to populate when local PGO is off (an AssertionError).
    # torch's own patch: pytest's monkeypatch deletes a torch config entry on undo.
    payload = signed(one_artifact("pgo", "code", b"pgo state"))
    with (
        torch._dynamo.config.patch(automatic_dynamic_local_pgo=False),
        pytest.warns(CacheArtifactsIgnoredWarning, match="torch failed to populate") as seen,
    ):
        assert unpack_artifacts(payload, guard()) is False
    assert len(seen) == 1


@pytest.fixture
def own_artifacts():
    """torch's process-wide artifact record, fresh for this test and dropped after it."""
    with CacheArtifactManager.with_fresh_cache():
        yield


def save_with_an_autotune_artifact(
    tmp_path: Path, key: str, backend: str = "eager"
) -> tuple[Path, GPTModule]:
    """Train 2 steps, record an autotune artifact as inductor does on CUDA, checkpoint."""
    model = gpt()
    run = trainer(
        tmp_path, RegionalCompileStrategy(backend=backend, cache_dir=str(tmp_path / "a")), 2
    )
    run.fit(model, data())
    CacheArtifactManager.record_artifact("autotune", key, {"XBLOCK": 64, "num_warps": 4})
    path = tmp_path / "with_autotune.ckpt"
    run.save_checkpoint(path)
    return path, model


def resume(tmp_path: Path, path: Path, cache: Path, backend: str = "eager") -> GPTModule:
    resumed = gpt()
    strategy = RegionalCompileStrategy(backend=backend, cache_dir=str(cache))
    trainer(tmp_path, strategy, 4).fit(resumed, data(), ckpt_path=path)
    return resumed


def test_an_autotune_shaped_key_loads_into_a_sub_folder_and_the_run_resumes(
    tmp_path, own_artifacts
):
    path, _ = save_with_an_autotune_artifact(tmp_path, AUTOTUNE_KEY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheArtifactsIgnoredWarning)
        resumed = resume(tmp_path, path, tmp_path / "empty")
    written = tmp_path / "empty" / AUTOTUNE_KEY
    assert written.is_file() and b"num_warps" in written.read_bytes()
    assert len(resumed.losses) == 2


def test_an_escaping_key_resumes_cold_with_one_warning_and_writes_nothing_outside(
    tmp_path, own_artifacts
):
    path, _ = save_with_an_autotune_artifact(tmp_path, "../outside/escaped.best_config")
    with pytest.warns(CacheArtifactsIgnoredWarning, match="outside the cache directory") as seen:
        resumed = resume(tmp_path, path, tmp_path / "empty")
    assert len([w for w in seen if w.category is CacheArtifactsIgnoredWarning]) == 1
    assert not (tmp_path / "outside").exists()
    assert not any((tmp_path / "empty").rglob("*.best_config"))
    plain = gpt()  # the checkpoint's weights and optimizer state, resumed by plain Lightning
    trainer(tmp_path, "auto", 4).fit(plain, data(), ckpt_path=path)
    assert resumed.losses == pytest.approx(plain.losses, rel=1e-5)


def test_a_signature_over_other_bytes_or_another_guard_does_not_verify():
    payload = {"guard": guard(), "artifacts": b"x", "signature": sign(guard(), b"y")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not signed with this user's key"):
        assert unpack_artifacts(payload, guard()) is False
    other = dict(guard(), torch="0.0")
    payload = {"guard": guard(), "artifacts": b"x", "signature": sign(other, b"x")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not signed"):
        assert unpack_artifacts(payload, guard()) is False


@pytest.mark.inductor
def test_with_an_autotune_shaped_key_an_inductor_resume_starts_warm(tmp_path, own_artifacts):
    """The GPU failure, on CPU: inductor's artifacts plus a CUDA-shaped autotune key, resumed
    into an empty cache directory: every graph is served from the checkpoint's artifacts."""
    path, _ = save_with_an_autotune_artifact(tmp_path, AUTOTUNE_KEY, backend="inductor")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheArtifactsIgnoredWarning)
        resumed = resume(tmp_path, path, tmp_path / "empty", backend="inductor")
    assert (tmp_path / "empty" / AUTOTUNE_KEY).is_file()
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    assert len(resumed.losses) == 2
