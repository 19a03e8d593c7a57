"""How the background child starts: ``python .../background/entry.py FOLDER PARENT``.

The child needs torch and this package's core, not Lightning. ``python -m
lightning_regions.background.child`` would run the package's ``__init__`` first, which
imports the strategies and with them Lightning: seconds of imports at every child start,
before it compiles anything. Run as a script, this file puts the package in
``sys.modules`` with its ``__init__`` not yet run, so its submodules import as usual, and
runs that ``__init__`` on the first top-level name asked of the package (a shipped user
module's ``from lightning_regions import ...``), so nothing behaves otherwise.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "lightning_regions"


def package_without_init() -> ModuleType:
    """The package as a module whose ``__init__`` runs on its first top-level name."""
    folder = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(
        PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    loader = spec.loader
    package = importlib.util.module_from_spec(spec)

    def run_init(name: str) -> object:
        del package.__dict__["__getattr__"]  # once: a name still missing then is missing
        loader.exec_module(package)
        return getattr(package, name)

    package.__dict__["__getattr__"] = run_init
    return package


def main() -> int:
    del sys.path[0]  # this file's folder: its modules are the package's, not top-level ones
    sys.modules.setdefault(PACKAGE, package_without_init())
    from lightning_regions.background.child import main as child_main

    return child_main(sys.argv[1], int(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
