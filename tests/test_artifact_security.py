"""A checkpoint stays data: compile artifacts from elsewhere never run code or write
outside the cache directory, and the user's own artifacts still give a warm start."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_lightning import data, gpt, trainer
from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager
from torch.utils._appending_byte_serializer import AppendingByteSerializer

from lightning_regions import RegionalCompileStrategy
from lightning_regions.cache import (
    CHECKPOINT_KEY,
    KEY_ENVIRONMENT_VARIABLE,
    CacheArtifactsIgnoredWarning,
    CacheArtifactsRefusedError,
    artifact_guard,
    artifact_key,
    key_path,
    sign,
    unpack_artifacts,
)


class MakesADirectory:
    """A pickle that runs code when loaded: it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def malicious_artifacts(marker: Path, outside: Path) -> bytes:
    """torch-serialised artifacts: a code-running pickle under an absolute-path key."""
    import pickle

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


def test_signed_artifacts_of_a_shape_torch_never_writes_are_refused(tmp_path):
    marker, outside = tmp_path / "marker", tmp_path / "outside"
    artifacts = malicious_artifacts(marker, outside)
    payload = {"guard": guard(), "artifacts": artifacts, "signature": sign(guard(), artifacts)}
    with pytest.raises(CacheArtifactsRefusedError, match="not a plain file name"):
        unpack_artifacts(payload, guard())
    with pytest.raises(CacheArtifactsRefusedError, match="not a plain file name"):
        unpack_artifacts({"guard": guard(), "artifacts": artifacts}, guard(), trust_unsigned=True)
    assert not marker.exists() and not outside.exists()


def test_a_signature_over_other_bytes_or_another_guard_does_not_verify():
    payload = {"guard": guard(), "artifacts": b"x", "signature": sign(guard(), b"y")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not signed with this user's key"):
        assert unpack_artifacts(payload, guard()) is False
    other = dict(guard(), torch="0.0")
    payload = {"guard": guard(), "artifacts": b"x", "signature": sign(other, b"x")}
    with pytest.warns(CacheArtifactsIgnoredWarning, match="not signed"):
        assert unpack_artifacts(payload, guard()) is False
