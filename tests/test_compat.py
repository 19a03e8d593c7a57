"""The torch version check and the version gates: every private API we use exists here,
a missing one is named with the torch version, and every gate names releases, what torch
does and a test that exists."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from lightning_regions import compat, lightning_compat

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


#: Private names read outside compat on purpose, each with why it is not torch's or
#: Lightning's: our own attributes, the standard library's, transformers' model hints.
NOT_TORCH_OR_LIGHTNING = {
    "_lightning_regions_tracker": "ours",
    "_lightning_regions_nested_of": "ours",
    "_lightning_regions_kv_cache_hook": "ours",
    "_lightning_regions_hook": "ours",
    "_getframe": "sys",
    "_exit": "os",
    "_repeated_blocks": "transformers' PreTrainedModel hint",
    "_no_split_modules": "transformers' PreTrainedModel hint",
    "_v": "a fragment of a trampoline's name",
}


def _private_names_outside_compat() -> list[str]:
    found = []
    package = ROOT / "lightning_regions"
    for path in sorted(package.rglob("*.py")):
        if path.name in ("compat.py", "lightning_compat.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            elif isinstance(node, ast.ImportFrom) and node.module:
                private = [part for part in node.module.split(".") if part.startswith("_")]
                name = private[0] if private and private != ["__future__"] else None
            if name and re.fullmatch(r"_[a-zA-Z]\w*", name) and name not in NOT_TORCH_OR_LIGHTNING:
                found.append(f"{path.relative_to(package).as_posix()}:{node.lineno} {name}")
    return found


def test_no_private_torch_or_lightning_name_is_read_outside_the_compat_modules():
    assert _private_names_outside_compat() == []


def test_the_scan_finds_a_private_read(tmp_path, monkeypatch):
    package = tmp_path / "lightning_regions" / "core"  # a module in a folder of the package
    package.mkdir(parents=True)
    (package / "leak.py").write_text(
        "from torch._dynamo import config\n"
        "def f(m):\n    return m._modules, getattr(m, '_trainer')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _private_names_outside_compat() == [
        "core/leak.py:1 _dynamo",
        "core/leak.py:3 _modules",
        "core/leak.py:3 _trainer",
    ]


def test_the_module_slot_accessors_read_what_torch_keeps():
    parent = torch.nn.Module()
    parent.block = torch.nn.Linear(2, 2)
    parent.register_module("empty", None)
    parent.scale = torch.nn.Parameter(torch.ones(1))
    parent.register_buffer("steps", torch.zeros(1))
    assert compat.registered_children(parent) == {"block": parent.block, "empty": None}
    assert compat.registered_parameters(parent) == {"scale": parent.scale}
    assert compat.registered_buffers(parent) == {"steps": parent.steps}

    wrapped = torch.compile(parent.block, backend="eager")
    assert compat.compiled_source(wrapped) is parent.block
    assert compat.COMPILED_SOURCE in dict(wrapped.named_children())

    assert compat.compiled_call(parent.block) is None
    parent.block.compile(backend="eager")
    assert compat.compiled_call(parent.block) is not None
    x = torch.randn(3, 2)
    torch.testing.assert_close(compat.call_past_compiled(parent.block, x), parent.block.forward(x))


def test_the_fabric_wrapper_is_unwrapped():
    from lightning.fabric import Fabric

    model = torch.nn.Linear(2, 2)
    wrapped = Fabric(accelerator="cpu", devices=1).setup_module(model)
    assert wrapped is not model
    assert lightning_compat.fabric_original_module(wrapped) is model
    assert lightning_compat.fabric_original_module(model) is model
