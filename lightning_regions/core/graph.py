"""Snapshots of a module graph: every registration, aliases and ``None`` children kept.

``nn.Module.named_modules()`` de-duplicates: a module registered under two names shows
up once, and ``None`` children not at all. The functions here walk ``_modules`` without
de-duplication, so what the model *is* (its aliases, shared blocks and tied
parameters) can be recorded, compared and preserved.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..compat import (
    COMPILED_SOURCE,
    OptimizedModule,
    compiled_source,
    registered_children,
    registered_parameters,
)

#: On a nested region's marked subclass (``nested.mark_nested``): the class it marks.
MARKED_FROM = "_lightning_regions_nested_of"
#: Path segments added by wrappers, not by the model: ``torch.compile`` registers the
#: original module as ``_orig_mod`` inside an ``OptimizedModule``.
WRAPPER_SEGMENTS = frozenset({COMPILED_SOURCE})


def canonical_path(path: str) -> str:
    """Drop wrapper segments such as ``_orig_mod`` from a dotted module path."""
    return ".".join(part for part in path.split(".") if part and part not in WRAPPER_SEGMENTS)


def unwrap(module: nn.Module) -> nn.Module:
    """The module under any ``torch.compile`` wrappers."""
    while isinstance(module, OptimizedModule):
        module = compiled_source(module)
    return module


def model_class(module: nn.Module) -> type:
    """The model's own class of ``module``: under ``torch.compile`` wrappers, and not
    the ``FSDP<Class>`` subclass that FSDP2's ``fully_shard`` swaps in, nor the marked
    subclass of a nested region."""
    cls = type(unwrap(module))
    if issubclass(cls, FSDPModule) and cls.__bases__[0] is FSDPModule:
        cls = cls.__bases__[-1]
    return cls.__dict__.get(MARKED_FROM, cls)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def compress_paths(paths: Iterable[str]) -> str:
    """``encoder.block.1, ..., encoder.block.11`` as ``encoder.block.1-11``."""
    by_prefix: dict[str, list[int]] = {}
    loose: list[str] = []
    for path in paths:
        match = re.fullmatch(r"(.*\.)(\d+)", path)
        if match:
            by_prefix.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            loose.append(path or "<root>")
    return ", ".join([prefix + _ranges(numbers) for prefix, numbers in by_prefix.items()] + loose)


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    numbers = sorted(numbers)
    runs = [[numbers[0], numbers[0]]]
    for number in numbers[1:]:
        if number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def iter_registrations(root: nn.Module) -> Iterator[tuple[str, nn.Module | None]]:
    """Yield ``(path, child)`` for every registration below ``root``, root first as ``""``.

    Nothing is de-duplicated: a module registered under several names is yielded once
    per name (and its subtree once per name), and ``None`` children are yielded as
    ``None``. A module that is its own ancestor (a cycle) is yielded but not entered.
    """
    yield "", root
    yield from _iter_below(root, "", frozenset({id(root)}))


def _iter_below(
    module: nn.Module, prefix: str, ancestors: frozenset[int]
) -> Iterator[tuple[str, nn.Module | None]]:
    for name, child in registered_children(module).items():
        path = join(prefix, name)
        yield path, child
        if child is not None and id(child) not in ancestors:
            yield from _iter_below(child, path, ancestors | {id(child)})


@dataclass(frozen=True)
class ModuleGraph:
    """What a model is: every module path and parameter path, wrappers looked through.

    ``modules`` maps each canonical path to the unwrapped module registered there (or
    ``None``); ``parameters`` maps each canonical parameter path to its ``Parameter``.
    """

    modules: dict[str, nn.Module | None]
    parameters: dict[str, nn.Parameter]

    @cached_property
    def _paths_by_module(self) -> dict[int, tuple[nn.Module, list[str]]]:
        """Each distinct module with its paths, in first-registration order (built once)."""
        index: dict[int, tuple[nn.Module, list[str]]] = {}
        for path, module in self.modules.items():
            if module is not None:
                index.setdefault(id(module), (module, []))[1].append(path)
        return index

    def paths_of(self, module: nn.Module) -> list[str]:
        """Every canonical path under which ``module`` (unwrapped) is registered."""
        return list(self._paths_by_module.get(id(unwrap(module)), (None, []))[1])

    def distinct_modules(self) -> list[nn.Module]:
        """Each registered module once, in first-registration order."""
        return [module for module, _ in self._paths_by_module.values()]

    @property
    def alias_groups(self) -> list[tuple[str, ...]]:
        """Groups of two or more module paths that name one module."""
        return _groups(self.modules)

    @property
    def tie_groups(self) -> list[tuple[str, ...]]:
        """Groups of two or more parameter paths that name one ``Parameter``."""
        return _groups(self.parameters)

    def own_alias_groups(self) -> list[tuple[str, ...]]:
        """``alias_groups`` without the paths an alias higher up already implies.

        ``blocks_alias = blocks`` makes ``blocks_alias.0`` an alias of ``blocks.0``; only
        ``blocks = blocks_alias`` is kept. Reports use this form.
        """
        return _own_groups(self.alias_groups, self._first_paths())

    def own_tie_groups(self) -> list[tuple[str, ...]]:
        """``tie_groups`` without the paths that a module alias already implies."""
        return _own_groups(self.tie_groups, self._first_paths())

    def _first_paths(self) -> set[str]:
        return {paths[0] for _, paths in self._paths_by_module.values()}

    @property
    def none_paths(self) -> list[str]:
        """Paths registered as ``None``."""
        return [path for path, m in self.modules.items() if m is None]


def _groups(named: Mapping[str, object | None]) -> list[tuple[str, ...]]:
    by_object: dict[int, list[str]] = {}
    for path, obj in named.items():
        if obj is not None:
            by_object.setdefault(id(obj), []).append(path)
    return [tuple(paths) for paths in by_object.values() if len(paths) > 1]


def _own_groups(groups: list[tuple[str, ...]], first_paths: set[str]) -> list[tuple[str, ...]]:
    def parent_is_first(path: str) -> bool:
        return path.rpartition(".")[0] in first_paths

    own = [tuple(p for p in group if parent_is_first(p)) for group in groups]
    return [group for group in own if len(group) > 1]


def snapshot(root: nn.Module) -> ModuleGraph:
    """Record every module and parameter registration below ``root``.

    Paths are canonical (wrapper segments dropped) and modules unwrapped, so a model
    and its compiled counterpart give equal path sets.
    """
    modules: dict[str, nn.Module | None] = {}
    parameters: dict[str, nn.Parameter] = {}
    for raw_path, module in iter_registrations(root):
        path = canonical_path(raw_path)
        if module is None:
            modules.setdefault(path, None)
            continue
        module = unwrap(module)
        modules[path] = module
        for name, param in registered_parameters(module).items():
            if param is not None:
                parameters[join(path, name)] = param
    return ModuleGraph(modules=modules, parameters=parameters)
