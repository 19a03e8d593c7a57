"""The package's imports point one way, down its layers (docs/architecture.md): nothing
below imports from above, and ``graph.py`` reads torch only through ``compat``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_regions"

#: The package's layers, bottom first, as docs/architecture.md names them; within a
#: layer, the modules in the order their imports allow. A module imports only modules
#: before it in this order: its own layer's earlier ones, and the layers below.
LAYERS = {
    "torch's names, the options and the disk": ("compat", "cache", "shipment", "options"),
    "plan": ("graph", "nested", "trampolines", "kv_cache", "regions", "variants", "sharding"),
    "apply and observe": ("watch", "tracking", "compile", "recipe", "background_child"),
    "judge and report": ("diagnosis", "report", "tiecheck"),
    "Lightning and Fabric glue": (
        "environment",
        "first_step",
        "payoff",
        "background",
        "strategy",
        "fabric",
        "fsdp",
        "wrapping",
        "compose",
        "cli",
        "warnings",
        "__init__",
    ),
}
ORDER = [module for modules in LAYERS.values() for module in modules]
LAYER = {name: place for place, name in enumerate(ORDER)}


def imports_of(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "__init__")
            if node.module is None:
                found |= {alias.name for alias in node.names}
    return found - {"__init__"}


def test_every_module_has_a_layer():
    assert {path.stem for path in PACKAGE.glob("*.py")} == set(LAYER)


def test_imports_point_down_the_data_flow():
    upward = [
        f"{module} ({LAYER[module]}) imports {imported} ({LAYER[imported]}), later in ORDER"
        for module in LAYER
        for imported in sorted(imports_of(module))
        if LAYER[imported] >= LAYER[module]
    ]
    assert not upward


def test_graph_reads_torch_only_through_compat():
    assert imports_of("graph") == {"compat"}


def test_the_architecture_page_names_every_module_and_layer():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert [name for name in sorted(LAYER) if f"`{name}.py`" not in page] == []
    assert [layer for layer in LAYERS if layer.lower() not in page.lower()] == []
