"""Choosing regions: which distinct modules of a model get compiled.

Three sources, in order of precedence:

1. ``regions=``: selectors from the user, each a class name or a path glob.
2. Model hints: a ``_repeated_blocks`` (diffusers) or ``_no_split_modules``
   (transformers) class attribute that names block classes.
3. Automatic: every ``ModuleList`` or ``Sequential`` whose entries are two or more
   modules of one class.

Each distinct module appears in the plan once, with all of its paths. A candidate
that lies inside another candidate is dropped: the outer one compiles it. Containers
without ``forward`` (``ModuleList``, ``ModuleDict``) are never regions; a selector that
names one selects its entries. A ``Sequential`` is callable, so it can be a block.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .graph import ModuleGraph, snapshot, unwrap

CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
#: Containers with no ``forward``: never a region, they stand for their entries.
LIST_TYPES = (nn.ModuleList, nn.ModuleDict)
HINT_ATTRIBUTES = ("_repeated_blocks", "_no_split_modules")

Selectors = str | Iterable[str] | None


class NoRepeatedBlocksWarning(UserWarning):
    """The model has no repeated blocks, so the whole model is one region."""


@dataclass(frozen=True)
class Region:
    """One distinct module to compile, every path it is registered under, and why."""

    module: nn.Module
    paths: tuple[str, ...]
    reason: str

    @property
    def class_name(self) -> str:
        return type(unwrap(self.module)).__name__

    @property
    def label(self) -> str:
        """``Class at path, path``: how messages name the region."""
        return f"{self.class_name} at {', '.join(p or '<root>' for p in self.paths)}"


@dataclass(frozen=True)
class RegionPlan:
    """The regions chosen for a model, with the snapshot they were chosen from."""

    regions: tuple[Region, ...]
    graph: ModuleGraph
    whole_model: bool = False

    def region_ids(self) -> set[int]:
        return {id(region.module) for region in self.regions}


def find_regions(module: nn.Module, regions: Selectors = None) -> RegionPlan:
    """Plan regional compilation of ``module`` without compiling anything.

    Raises ``ValueError`` when a selector in ``regions`` matches nothing. Warns with
    ``NoRepeatedBlocksWarning`` and plans the whole model as one region when no
    repeated block is found.
    """
    graph = snapshot(module)
    selectors = _as_list(regions)
    if selectors:
        candidates = _select(graph, selectors)
    else:
        candidates = _from_hints(graph) or _repeated_blocks(graph)
    if not candidates:
        warnings.warn(
            f"{type(module).__name__} has no repeated blocks (no ModuleList/Sequential of "
            "two or more modules of one class, and no _repeated_blocks or _no_split_modules "
            "hint), so the whole model is compiled as one region. Pass regions=[...] with "
            "class names or path globs to choose blocks.",
            NoRepeatedBlocksWarning,
            stacklevel=2,
        )
        root = unwrap(module)
        whole = Region(module=root, paths=("",), reason="whole model: no repeated blocks")
        return RegionPlan(regions=(whole,), graph=graph, whole_model=True)
    outermost = _drop_nested(candidates)
    chosen = tuple(
        Region(module=m, paths=tuple(graph.paths_of(m)), reason=reason) for m, reason in outermost
    )
    return RegionPlan(regions=chosen, graph=graph)


def _as_list(regions: Selectors) -> list[str]:
    if regions is None:
        return []
    if isinstance(regions, str):
        return [regions]
    return list(regions)


def _entries(container: nn.Module) -> list[nn.Module]:
    return [child for child in container._modules.values() if child is not None]


def _expand_containers(module: nn.Module) -> list[nn.Module]:
    """A ``ModuleList``/``ModuleDict`` stands for its entries; anything else for itself."""
    if isinstance(module, LIST_TYPES):
        return [leaf for child in _entries(module) for leaf in _expand_containers(child)]
    return [module]


def _select(graph: ModuleGraph, selectors: list[str]) -> list[tuple[nn.Module, str]]:
    candidates: dict[int, tuple[nn.Module, str]] = {}
    unmatched = []
    for selector in selectors:
        matched = False
        for module in graph.distinct_modules():
            cls = type(module)
            paths = graph.paths_of(module)
            if selector in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
                why = f"class name matches {selector!r}"
            elif any(fnmatch.fnmatchcase(path, selector) for path in paths if path):
                why = f"path matches {selector!r}"
            else:
                continue
            matched = True
            for target in _expand_containers(module):
                candidates.setdefault(id(target), (target, why))
        if not matched:
            unmatched.append(selector)
    if unmatched:
        raise ValueError(
            f"regions={unmatched!r} matched no module. Selectors are class names or path "
            f"globs such as 'layers.*'. Block classes seen: {_block_classes(graph)}; "
            f"container paths seen: {_container_paths(graph)}."
        )
    return list(candidates.values())


def _from_hints(graph: ModuleGraph) -> list[tuple[nn.Module, str]]:
    hinted: dict[str, str] = {}
    for module in graph.distinct_modules():
        for attribute in HINT_ATTRIBUTES:
            for class_name in getattr(type(module), attribute, None) or ():
                hinted.setdefault(class_name, f"{type(module).__name__}.{attribute}")
    if not hinted:
        return []
    found = [
        (block, f"named by {hinted[type(m).__name__]}")
        for m in graph.distinct_modules()
        if type(m).__name__ in hinted
        for block in _expand_containers(m)
    ]
    if not found:
        warnings.warn(
            f"Block classes {sorted(hinted)} named by model hints are not in the model; "
            "falling back to automatic detection of repeated blocks.",
            stacklevel=3,
        )
    return found


def _repeated_blocks(graph: ModuleGraph) -> list[tuple[nn.Module, str]]:
    candidates: dict[int, tuple[nn.Module, str]] = {}
    for path, container in graph.modules.items():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        entries = _entries(container)
        classes = {type(unwrap(child)) for child in entries}
        if len(entries) < 2 or len(classes) != 1 or issubclass(next(iter(classes)), LIST_TYPES):
            continue  # a list of lists is walked level by level instead
        why = f"repeated {classes.pop().__name__} in '{path}' ({len(entries)} entries)"
        for child in entries:
            candidates.setdefault(id(child), (child, why))
    return list(candidates.values())


def _drop_nested(candidates: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """Keep only candidates that are not descendants of another candidate."""
    inside: set[int] = set()
    for module, _ in candidates:
        inside.update(id(m) for m in module.modules() if m is not module)
    return [(m, why) for m, why in candidates if id(m) not in inside]


def _block_classes(graph: ModuleGraph) -> list[str]:
    return sorted({type(m).__name__ for m in graph.distinct_modules()})


def _container_paths(graph: ModuleGraph) -> list[str]:
    return [p for p, m in graph.modules.items() if isinstance(m, CONTAINER_TYPES)]
