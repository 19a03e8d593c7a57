"""Marking regions as torch nested compile regions (``granularity="nested"``).

torch's ``nested_compile_region`` makes one whole-model graph in which a marked
function is traced once and stamped out at every later call. Its reuse check swaps
the sources of the function's explicit arguments (``L['self'].blocks[0]`` for
``blocks[1]``), so the module must reach the marked function as an argument: a
``forward`` bound to one instance reuses that instance's weights for every block
(measured on torch 2.13: silently wrong outputs). So a region is marked by giving it,
and only it, a subclass of its own class whose ``forward`` is the marked one: identity,
``state_dict`` keys, hooks and ``isinstance`` are unchanged, other instances of the
class and other models are untouched, and one marked subclass per class lets torch
reuse one traced block across every region of that class, checking its guards per call.
"""

from __future__ import annotations

import copyreg
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import (
    MODULE_CHILDREN,
    NESTED_BACKWARD_BUFFER_REUSE,
    inductor_mode_options,
    is_nested_compile_region,
)
from .graph import MARKED_FROM

#: The higher-order op a nested region becomes in dynamo's graph.
INVOKE_SUBGRAPH = "invoke_subgraph"

_MARKED_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


class NestedRegionError(RuntimeError):
    """torch could not compile a region as a nested compile region; names it and the fix."""


def is_marked(module: nn.Module) -> bool:
    """True when ``module``'s ``forward`` is a torch nested compile region."""
    return is_nested_compile_region(type(module).forward)


def marked_class(cls: type[nn.Module]) -> type[nn.Module]:
    """One subclass of ``cls`` per process whose ``forward`` is a nested compile region.

    A marked instance pickles and copies as an instance of ``cls`` itself, as torch drops
    a module's compiled call when it is saved or copied: the copy is the plain module,
    and loading it needs neither this subclass nor lightning_regions."""
    marked = _MARKED_CLASSES.get(cls)
    if marked is None:

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            reduced = super(type(self), self).__reduce_ex__(protocol)
            if not isinstance(reduced, tuple):
                return reduced
            function, arguments, *rest = reduced
            if not arguments or arguments[0] is not type(self):
                return reduced
            if function is copyreg.__newobj__:  # type: ignore[attr-defined]  # not in typeshed
                # pickle checks that __newobj__ builds the object's own class: call the
                # user's class's __new__ instead (protocol 2 and up)
                return (cls.__new__, (cls, *arguments[1:]), *rest)
            return (function, (cls, *arguments[1:]), *rest)  # copyreg._reconstructor

        namespace = {
            "forward": torch.compiler.nested_compile_region(cls.forward),
            "__reduce_ex__": __reduce_ex__,
            MARKED_FROM: cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        marked = type(cls.__name__, (cls,), namespace)
        _MARKED_CLASSES[cls] = marked
    return marked


def mark_nested(module: nn.Module) -> nn.Module:
    """Make ``module`` (in place) a nested compile region; already marked: unchanged."""
    if not is_marked(module):
        module.__class__ = marked_class(type(module))
    return module


#: Inductor options for a graph that holds nested regions, on the torch releases where
#: inductor reuses buffers across the calls of a nested region's backward (silently
#: wrong gradients, right outputs; ``compat.NESTED_BACKWARD_BUFFER_REUSE`` has the
#: releases and the measurements). Turning off buffer reuse gives gradients equal to
#: eager in every case measured; turning off only in-place buffers does not.
NESTED_INDUCTOR_OPTIONS: dict[str, Any] = (
    {"allow_buffer_reuse": False} if NESTED_BACKWARD_BUFFER_REUSE.applies else {}
)


def inductor_options_for_nested(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """``mode``'s and ``options``' inductor settings with ``NESTED_INDUCTOR_OPTIONS`` on
    top, as one ``options`` dict (torch.compile takes a mode or options, not both)."""
    merged = inductor_mode_options(mode or "default")
    return {**merged, **(options or {}), **NESTED_INDUCTOR_OPTIONS}


@dataclass(frozen=True)
class NestedCall:
    """One call of a nested region in a graph dynamo compiled."""

    subgraph: str  # the traced block it runs, named within that graph
    path: str  # the module path dynamo called, relative to the compiled unit


@dataclass(frozen=True)
class GraphNesting:
    """What one compiled graph says about nested regions: the nested calls in graph
    order, and every module path its operations came from (a call torch inlined shows
    up there, not as a nested call)."""

    calls: tuple[NestedCall, ...]
    module_paths: frozenset[str]


def graph_nesting(gm: torch.fx.GraphModule) -> GraphNesting:
    """Read ``gm``'s nested-region calls and module paths from its nodes' metadata, in
    ``gm`` and in the bodies of its other higher-order ops (a ``torch.utils.checkpoint``
    call becomes one, with the nested calls inside it), not inside the traced blocks."""
    calls: list[NestedCall] = []
    paths: set[str] = set()
    for graph in _graphs_outside_nested_regions(gm):
        for node in graph.nodes:
            sources = node.meta.get("nn_module_stack", {}).values()
            stack = [_module_path(source) for source, _ in sources]
            paths.update(stack)
            if _is_nested_call(node):
                identifier = node.args[1] if len(node.args) > 1 else node.args[0]
                calls.append(NestedCall(str(identifier), stack[-1] if stack else ""))
    return GraphNesting(tuple(calls), frozenset(paths))


def _is_nested_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and INVOKE_SUBGRAPH in str(node.target)


def _graphs_outside_nested_regions(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    blocks = {
        node.args[0].target
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if _is_nested_call(node) and isinstance(node.args[0], torch.fx.Node)
    }
    return [
        module.graph
        for name, module in gm.named_modules()
        if isinstance(module, torch.fx.GraphModule) and name.rpartition(".")[2] not in blocks
    ]


def _module_path(source: str) -> str:
    """``L['self'].blocks[1]`` (dynamo's source of the module) as ``blocks.1``: relative to
    the frame's module, ``self`` or, under a ``wrapper(*args)`` decorator, ``args[0]``."""
    path = re.sub(r"^L\[['\"]\w+['\"]\](\[\d+\])?\.?", "", source)
    path = re.sub(rf"\.{MODULE_CHILDREN}\[['\"](\w+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path)
    return path.lstrip(".")


#: What removes a nested region traced again per instance.
NESTED_TRACED_APART_FIX = (
    "store per-instance numbers as tensor buffers (register_buffer) or make them the "
    "same on every instance (TORCH_LOGS=+hierarchical_compile names the guard), or use "
    "granularity='regions'"
)

#: torch's failures of nested regions: what to look for in the error, what it means, the fix.
NESTED_FAILURES = (
    (
        ("maximum reuse entries",),
        "an attribute differs on every instance (a number such as a layer index or a "
        "scale), so torch traced the block again for each one until its reuse limit",
        NESTED_TRACED_APART_FIX,
    ),
    (
        ("aliasing",),
        "the block returns one of its inputs (or a view of it) unchanged",
        "return input.clone() (or do not return the input), or use granularity='regions'",
    ),
    (
        ("in-place operation", "mutation"),
        "the block mutates one of its inputs in place",
        "use an out-of-place operation on the input, or granularity='regions'",
    ),
    (
        ("captured completely",),
        "the block has a graph break, which a nested region cannot have",
        "remove the graph break (TORCH_LOGS=graph_breaks names it), or use granularity='regions'",
    ),
)


def _some(labels: list[str], shown: int = 3) -> str:
    if len(labels) <= shown:
        return ", ".join(labels)
    return f"{', '.join(labels[:shown])} and {len(labels) - shown} more"


def explain_nested_failure(
    error: BaseException, unit: str, regions: list[str]
) -> NestedRegionError | None:
    """A ``NestedRegionError`` naming ``regions``, torch's limit and the fix, when
    ``error`` (or an error it was raised from) is a nested-region failure; else None."""
    text = ""
    seen: BaseException | None = error
    while seen is not None:
        text += f"{type(seen).__name__}: {seen}\n"
        seen = seen.__cause__ or seen.__context__
    if INVOKE_SUBGRAPH not in text and "higher order op" not in text.lower():
        return None
    what, fix = next(
        ((what, fix) for needles, what, fix in NESTED_FAILURES if any(n in text for n in needles)),
        ("torch failed inside a nested region", "use granularity='regions'"),
    )
    first = next((line for line in text.splitlines() if line.strip()), "")
    return NestedRegionError(
        f"granularity='nested': torch could not compile {_some(regions)} as nested "
        f"regions inside {unit}: {what}. Fix: {fix}. torch said: {first[:400]}"
    )
