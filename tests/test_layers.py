"""The package's imports point one way, down its layers (docs/architecture.md): each
layer is a folder (or the root's few modules), nothing imports from a layer above its
own or from a sibling layer, and ``core/graph.py`` reads torch only through ``compat``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_regions"

#: The package's layers, bottom first, as docs/architecture.md names them, each with its
#: rank and its modules (paths below the package, without ``.py``) in the order their
#: imports allow. A module imports only modules of a layer of lower rank and its own
#: layer's earlier ones: layers of one rank (diagnosis, background, gate) are siblings
#: that import nothing of each other.
LAYERS: dict[str, tuple[int, tuple[str, ...]]] = {
    "torch's and Lightning's names, the options and the disk": (
        0,
        ("compat", "lightning_compat", "cache", "options"),
    ),
    "plan, apply and observe": (
        1,
        (
            "core/__init__",
            "core/graph",
            "core/nested",
            "core/trampolines",
            "core/calls",
            "core/kv_cache",
            "core/regions",
            "core/variants",
            "core/sharding",
            "core/watch",
            "core/tracking",
            "core/compile",
            "core/progress",
            "core/recipe",
        ),
    ),
    "judge and report": (
        2,
        (
            "diagnosis/__init__",
            "diagnosis/judge",
            "diagnosis/pieces",
            "diagnosis/report",
            "diagnosis/tiecheck",
        ),
    ),
    "the background compile": (
        2,
        (
            "background/__init__",
            "background/threads",
            "background/shipment",
            "background/child",
            "background/entry",
            "background/switch",
        ),
    ),
    "the keep-or-revert gate": (2, ("gate/__init__", "gate/clock", "gate/decision", "gate/gate")),
    "Lightning and Fabric glue": (
        3,
        (
            "strategies/__init__",
            "strategies/environment",
            "strategies/first_step",
            "strategies/status",
            "strategies/figures",
            "strategies/trainer",
            "strategies/fabric",
            "strategies/fsdp",
            "strategies/wrapping",
            "strategies/compose",
        ),
    ),
    "the public faces": (4, ("fabric", "cli", "warnings", "__init__")),
}
PLACE = {
    module: (layer, rank, index)
    for layer, (rank, modules) in LAYERS.items()
    for index, module in enumerate(modules)
}


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports (relative imports, resolved)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    here = module.split("/")[:-1]  # the folder of the module
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        base = here[: len(here) - (node.level - 1)]
        parts = [*base, *(node.module.split(".") if node.module else [])]
        if node.module is None:  # from . import a, b: modules, or names of a package
            for alias in node.names:
                name = "/".join([*parts, alias.name])
                found.add(name if name in PLACE else "/".join([*parts, "__init__"]))
        else:
            name = "/".join(parts)
            found.add(name if name in PLACE else f"{name}/__init__")
    return found - {"__init__"}


def allowed(module: str, imported: str) -> bool:
    layer, rank, index = PLACE[module]
    their_layer, their_rank, their_index = PLACE[imported]
    if layer == their_layer:
        return their_index < index
    return their_rank < rank


def test_every_module_has_a_layer():
    found = {path.relative_to(PACKAGE).with_suffix("").as_posix() for path in PACKAGE.rglob("*.py")}
    assert found == set(PLACE)


def test_imports_point_down_the_layers():
    upward = [
        f"{module} ({PLACE[module][0]}) imports {imported} ({PLACE[imported][0]})"
        for module in PLACE
        for imported in sorted(imports_of(module))
        if not allowed(module, imported)
    ]
    assert not upward


def test_the_check_finds_an_import_from_a_sibling_layer_and_from_above():
    assert not allowed("gate/gate", "diagnosis/report")
    assert not allowed("core/compile", "strategies/trainer")
    assert not allowed("core/graph", "core/compile")
    assert allowed("strategies/trainer", "gate/gate")


def test_graph_reads_torch_only_through_compat():
    assert imports_of("core/graph") == {"compat"}


def test_the_architecture_page_names_every_module_and_layer():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    modules = [module for module in PLACE if not module.endswith("__init__")]
    assert [name for name in modules if f"`{name}.py`" not in page] == []
    assert [layer for layer in LAYERS if layer.lower() not in page.lower()] == []
