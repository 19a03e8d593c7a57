"""The package's imports point one way, down the data flow (docs/architecture.md):
nothing below imports from above, and ``graph.py`` reads torch only through ``compat``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_regions"

#: Bottom first: torch's private names, the snapshot, what compiles, what observes,
#: what judges and reports, then the Lightning glue.
LAYERS = (
    ("compat",),
    ("graph",),
    ("nested", "trampolines", "kv_cache"),
    ("regions",),
    ("variants", "sharding"),
    ("watch",),
    ("tracking",),
    ("cache", "shipment"),
    ("options",),
    ("compile",),
    ("recipe", "diagnosis"),
    ("report", "tiecheck", "background_child"),
    ("environment", "first_step", "background"),
    ("strategy",),
    ("fabric", "fsdp", "cli"),
    ("warnings",),
    ("__init__",),
)
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


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
        f"{module} (layer {LAYER[module]}) imports {imported} (layer {LAYER[imported]})"
        for module in LAYER
        for imported in sorted(imports_of(module))
        if LAYER[imported] >= LAYER[module]
    ]
    assert not upward


def test_graph_reads_torch_only_through_compat():
    assert imports_of("graph") == {"compat"}


def test_the_architecture_page_names_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert [name for name in sorted(LAYER) if f"`{name}.py`" not in page] == []
