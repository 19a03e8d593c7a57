"""Choosing regions: which distinct modules of a model get compiled.

Three sources, in order of precedence:

1. ``regions=``: selectors from the user, each a class name or a path glob.
2. Model hints: a ``_repeated_blocks`` (diffusers) or ``_no_split_modules``
   (transformers) class attribute that names block classes.
3. Automatic, what runs repeatedly:
   - repeats in space: every ``ModuleList`` or ``Sequential`` whose entries are two or
     more modules of one class;
   - repeats in time: a ``ModuleList`` holding one block (accelerate's rule; ALBERT's
     layer group), and a block that its parent's ``forward`` calls inside a loop
     (looped and universal transformers), read from the bytecode of ``forward``.
     Both count only blocks with parameters whose class is not torch's own.

Without any of these, the fallback compiles what runs: the whole model when it is
called itself, else (``root_is_called=False``, a LightningModule under Lightning,
whose ``forward`` the training loop does not call) each top-level child that holds
parameters, as ``torch.compile(self.model)`` in ``configure_model`` would.

Each distinct module appears in the plan once, with all of its paths. A candidate
that lies inside another candidate is dropped: the outer one compiles it. Containers
without ``forward`` (``ModuleList``, ``ModuleDict``) are never regions; a selector that
names one selects its entries. A ``Sequential`` is callable, so it can be a block.
"""

from __future__ import annotations

import dis
import fnmatch
import itertools
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import CodeType

from torch import nn

from ..compat import registered_children
from .graph import ModuleGraph, model_class, snapshot, unwrap

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
        return model_class(self.module).__name__

    @property
    def label(self) -> str:
        """``Class at path, path``: how messages name the region."""
        return f"{self.class_name} at {', '.join(p or '<root>' for p in self.paths)}"


@dataclass(frozen=True)
class RegionPlan:
    """The regions chosen for a model, with the snapshot they were chosen from.

    ``regions`` are compiled each by itself. ``nested`` (``granularity="nested"``, see
    ``nest_plan``) are marked as nested compile regions inside them instead.
    """

    regions: tuple[Region, ...]
    graph: ModuleGraph
    whole_model: bool = False
    nested: tuple[Region, ...] = ()

    def region_ids(self) -> set[int]:
        return {id(region.module) for region in self.regions}

    def nested_ids(self) -> set[int]:
        return {id(region.module) for region in self.nested}

    def nested_in(self, unit: Region) -> tuple[Region, ...]:
        """The nested regions inside compiled unit ``unit``."""
        inside = {id(m) for m in unit.module.modules()}
        return tuple(region for region in self.nested if id(region.module) in inside)


def find_regions(
    module: nn.Module, regions: Selectors = None, *, root_is_called: bool = True
) -> RegionPlan:
    """Plan regional compilation of ``module`` without compiling anything.

    Raises ``ValueError`` when a selector in ``regions`` matches nothing. Warns with
    ``NoRepeatedBlocksWarning`` when no repeated block is found, and then plans the
    whole model, or (``root_is_called=False``) its top-level children with parameters.
    """
    graph = snapshot(module)
    selectors = _as_list(regions)
    if selectors:
        candidates = _select(graph, selectors)
    else:
        repeated = _repeated_blocks(graph)
        candidates = _from_hints(graph) or [
            *repeated,
            *_without_repeats_inside(_called_in_loops(graph), repeated),
        ]
    if not candidates:
        return _fallback_plan(module, graph, root_is_called)
    distinct: dict[int, tuple[nn.Module, str]] = {}
    for candidate, reason in candidates:  # a module found by two rules: the first reason
        distinct.setdefault(id(candidate), (candidate, reason))
    outermost = _drop_nested(list(distinct.values()))
    chosen = tuple(
        Region(module=m, paths=tuple(graph.paths_of(m)), reason=reason) for m, reason in outermost
    )
    return RegionPlan(regions=chosen, graph=graph)


def _fallback_plan(module: nn.Module, graph: ModuleGraph, root_is_called: bool) -> RegionPlan:
    root = unwrap(module)
    name = model_class(root).__name__
    searched = (
        "no ModuleList/Sequential of two or more modules of one class, no ModuleList of "
        "one block, no block called in a loop, and no _repeated_blocks or _no_split_modules hint"
    )
    fix = "Pass regions=[...] with class names or path globs to choose blocks."
    if root_is_called:
        warnings.warn(
            f"{name} has no repeated blocks ({searched}), so the whole model is compiled "
            f"as one region. {fix}",
            NoRepeatedBlocksWarning,
            stacklevel=3,
        )
        whole = Region(module=root, paths=("",), reason="whole model: no repeated blocks")
        return RegionPlan(regions=(whole,), graph=graph, whole_model=True)
    children = _top_level_children(root)
    warnings.warn(
        f"{name} has no repeated blocks ({searched}), and its own forward is not what the "
        f"training loop calls, so each top-level child with parameters is compiled whole: "
        f"{[graph.paths_of(child)[0] for child in children]}. {fix}",
        NoRepeatedBlocksWarning,
        stacklevel=3,
    )
    chosen = tuple(
        Region(
            module=child,
            paths=tuple(graph.paths_of(child)),
            reason="top-level child with parameters (no repeated blocks)",
        )
        for child in children
    )
    return RegionPlan(regions=chosen, graph=graph, whole_model=True)


def _top_level_children(root: nn.Module) -> list[nn.Module]:
    """Each distinct top-level child of ``root`` with parameters, containers expanded."""
    children = [
        entry
        for child in registered_children(root).values()
        if child is not None
        for entry in _expand_containers(child)
        if _has_parameters(entry)
    ]
    return list({id(child): child for child in children}.values())


def nest_plan(plan: RegionPlan, module: nn.Module, *, root_is_called: bool = True) -> RegionPlan:
    """The plan for ``granularity="nested"``: compile what training runs whole, with
    ``plan``'s regions inside it marked as nested compile regions.

    What runs is ``module`` itself, or (``root_is_called=False``) each top-level child
    with parameters, the units the fallback compiles; never a root nobody calls. A region
    that is such a unit, or lies in none, stays a region of its own.
    """
    if plan.whole_model:
        return plan
    root = unwrap(module)
    units = [root] if root_is_called else _top_level_children(root)
    unit_ids = {id(unit) for unit in units}
    inside_units = {id(m) for unit in units for m in unit.modules() if m is not unit}
    nested = tuple(
        region
        for region in plan.regions
        if id(region.module) in inside_units and id(region.module) not in unit_ids
    )
    if not nested:
        return plan
    nested_ids = {id(region.module) for region in nested}
    kept = [region for region in plan.regions if id(region.module) not in nested_ids]
    kept_ids = {id(region.module) for region in kept}
    for unit in units:
        if id(unit) in kept_ids:
            continue
        inside = {id(m) for m in unit.modules()}
        held = sorted({region.class_name for region in nested if id(region.module) in inside})
        reason = (
            f"compiled whole, {', '.join(held)} nested inside"
            if held
            else "compiled whole: what training runs"
        )
        paths = tuple(plan.graph.paths_of(unit)) or ("",)
        kept.append(Region(module=unit, paths=paths, reason=reason))
    return RegionPlan(regions=tuple(kept), graph=plan.graph, nested=nested)


def _as_list(regions: Selectors) -> list[str]:
    if regions is None:
        return []
    if isinstance(regions, str):
        return [regions]
    return list(regions)


def _entries(container: nn.Module) -> list[nn.Module]:
    return [child for child in registered_children(container).values() if child is not None]


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
            cls = model_class(module)
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
            for class_name in getattr(model_class(module), attribute, None) or ():
                hinted.setdefault(class_name, f"{model_class(module).__name__}.{attribute}")
    if not hinted:
        return []
    found = [
        (block, f"named by {hinted[model_class(m).__name__]}")
        for m in graph.distinct_modules()
        if model_class(m).__name__ in hinted
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
    """Blocks found through their container: two or more of one class in a ``ModuleList``
    or ``Sequential`` (repeats in space), or a ``ModuleList``'s only block, which is run in
    a loop (repeats in time; accelerate's rule)."""
    candidates: dict[int, tuple[nn.Module, str]] = {}
    for path, container in graph.modules.items():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        entries = _entries(container)
        if isinstance(container, nn.ModuleList) and len(entries) == 1:
            if _is_user_block(entries[0]):
                name = model_class(entries[0]).__name__
                why = f"one {name} in ModuleList '{path}', run repeatedly"
                candidates.setdefault(id(entries[0]), (entries[0], why))
            continue
        classes = {model_class(child) for child in entries}
        if len(entries) < 2 or len(classes) != 1 or issubclass(next(iter(classes)), LIST_TYPES):
            continue  # a list of lists is walked level by level instead
        why = f"repeated {classes.pop().__name__} in '{path}' ({len(entries)} entries)"
        for child in entries:
            candidates.setdefault(id(child), (child, why))
    return list(candidates.values())


def _is_user_block(module: nn.Module) -> bool:
    """A module with parameters whose code is not torch's own (a ``Sequential`` counts)."""
    cls = model_class(module)
    own_code = not cls.__module__.startswith("torch.") or isinstance(module, nn.Sequential)
    return own_code and not isinstance(module, LIST_TYPES) and _has_parameters(module)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _called_in_loops(graph: ModuleGraph) -> list[tuple[nn.Module, str]]:
    """Blocks that their parent's ``forward`` calls inside a loop: repeats in time."""
    found = []
    for parent in graph.distinct_modules():
        forward = type(parent).forward
        code = getattr(forward, "__code__", None)
        # a function defined where globals have no __name__ (exec'd code): __module__ None
        if code is None or (forward.__module__ or "").startswith("torch."):
            continue
        for name in sorted(_attributes_loaded_in_loops(code)):
            child = registered_children(parent).get(name)
            if child is not None and _is_user_block(child):
                where = f"{model_class(parent).__name__}.forward"
                found.append((child, f"{model_class(child).__name__} called in a loop in {where}"))
    return found


def _without_repeats_inside(
    looped: list[tuple[nn.Module, str]], repeated: list[tuple[nn.Module, str]]
) -> list[tuple[nn.Module, str]]:
    """The blocks called in a loop that hold no repeated block: a container such as
    DeBERTa's encoder (its ``forward`` reaches ``self.encoder`` in a loop over
    ``z_steps``) holds the real repeats, its layers, which are compiled instead, one graph
    for all of them, rather than the whole encoder as one region."""
    inner = {id(block) for block, _ in repeated}
    return [
        (block, why)
        for block, why in looped
        if not any(id(m) in inner for m in block.modules() if m is not block)
    ]


def _attributes_loaded_in_loops(code: CodeType, self_name: str | None = None) -> set[str]:
    """Names ``x`` of ``self.x`` loaded inside a loop of ``code`` or a comprehension in it.

    A loop is the span from a backward jump's target to the jump. Comprehensions and
    generator expressions compiled as their own code object are loops as a whole.
    """
    if self_name is None:
        self_name = code.co_varnames[0] if code.co_argcount else ""
    instructions = list(dis.get_instructions(code))
    loops = [
        (instruction.argval, instruction.offset)
        for instruction in instructions
        if "JUMP" in instruction.opname
        and isinstance(instruction.argval, int)
        and instruction.argval < instruction.offset
    ]
    whole = code.co_name in ("<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>")
    names = set()
    for before, instruction in itertools.pairwise(instructions):
        in_loop = whole or any(start <= instruction.offset <= end for start, end in loops)
        if (
            in_loop
            and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and before.opname.startswith(("LOAD_FAST", "LOAD_DEREF"))
            and before.argval == self_name
        ):
            names.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _attributes_loaded_in_loops(const, self_name)
    return names


def _drop_nested(candidates: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """Keep only candidates that are not descendants of another candidate."""
    inside: set[int] = set()
    for module, _ in candidates:
        inside.update(id(m) for m in module.modules() if m is not module)
    return [(m, why) for m, why in candidates if id(m) not in inside]


def _block_classes(graph: ModuleGraph) -> list[str]:
    return sorted({model_class(m).__name__ for m in graph.distinct_modules()})


def _container_paths(graph: ModuleGraph) -> list[str]:
    return [p for p, m in graph.modules.items() if isinstance(m, CONTAINER_TYPES)]
