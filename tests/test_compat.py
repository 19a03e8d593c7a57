"""The torch version check: every private API we use exists here, and a missing one is
named with the torch version instead of failing deep in a run."""

from __future__ import annotations

import pytest

from lightning_regions import compat


def test_this_torch_has_every_api_we_use():
    assert compat.missing_torch_apis() == []


def test_a_missing_api_is_named_with_the_torch_version(monkeypatch):
    apis = (*compat.PRIVATE_APIS, ("torch._dynamo.exc", "NoSuchThing", "a future need"))
    monkeypatch.setattr(compat, "PRIVATE_APIS", apis)
    with pytest.raises(ImportError, match=r"needs torch>=2\.7,<2\.14; this torch 2\..*NoSuchThing"):
        compat.require_torch_apis()


def test_the_declared_range_matches_setup_cfg():
    from pathlib import Path

    setup = (Path(__file__).parent.parent / "setup.cfg").read_text()
    assert f"torch{compat.SUPPORTED_TORCH}" in setup.replace(" ", "")
