"""The torch version check and the version gates: every private API we use exists here,
a missing one is named with the torch version, and every gate names releases, what torch
does and a test that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from lightning_regions import compat

ROOT = Path(__file__).parent.parent


def test_this_torch_has_every_api_we_use():
    assert compat.missing_torch_apis() == []


@pytest.mark.parametrize(
    "api",
    [
        ("torch._dynamo.exc", "NoSuchThing", "a future need"),
        ("torch.compiler._cache", "CacheArtifactFactory.no_such_table", "a future need"),
        ("torch._no_such_module", "anything", "a future need"),
    ],
)
def test_a_missing_api_is_named_with_the_torch_version(monkeypatch, api):
    monkeypatch.setattr(compat, "PRIVATE_APIS", (*compat.PRIVATE_APIS, api))
    declared = re.escape(compat.SUPPORTED_TORCH)
    missing = re.escape(f"{api[0]}.{api[1]} (a future need)")
    with pytest.raises(ImportError, match=rf"needs torch{declared}; this torch 2\..*{missing}"):
        compat.require_torch_apis()


def test_the_declared_range_matches_setup_cfg_and_the_readme_and_holds_this_torch():
    setup = (ROOT / "setup.cfg").read_text()
    assert f"torch{compat.SUPPORTED_TORCH}" in setup.replace(" ", "")
    assert f"`torch{compat.SUPPORTED_TORCH}`" in (ROOT / "README.md").read_text()
    declared = SpecifierSet(compat.SUPPORTED_TORCH)
    assert compat.TORCH_RELEASE in declared
    assert all(release in declared for release in compat.TESTED_TORCH)


def test_ci_runs_the_oldest_and_the_newest_tested_torch():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci
    oldest, newest = compat.TESTED_TORCH[0], compat.TESTED_TORCH[-1]
    assert f"TORCH={oldest}" in ci and f"TORCH={newest}" in ci


@pytest.mark.parametrize("name", list(compat.TORCH_GATES))
def test_every_gate_names_releases_and_a_test_that_exists(name):
    gate = compat.TORCH_GATES[name]
    SpecifierSet(gate.releases)  # a valid specifier
    assert gate.torch_does and gate.we_do
    path, _, test = gate.test.partition("::")
    assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.MULTILINE), gate.test
