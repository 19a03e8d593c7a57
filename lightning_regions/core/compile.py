"""Applying a region plan: one traversal, memoised by original module.

How a region is compiled and how a parent of regions is rebuilt are the only things
that differ between the two modes, so they are passed to the traversal as a small
object (``InPlace`` or ``OutOfPlace``) instead of being written twice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..compat import (
    COMPILED_CALL,
    FORWARD,
    OptimizedModule,
    compiled_call,
    compiled_source,
    registered_children,
    set_compiled_call,
    set_compiled_source,
    set_registered_children,
)
from ..options import validate_compile_arguments, validate_granularity, validate_on_compile_error
from .graph import unwrap
from .nested import inductor_options_for_nested, mark_nested
from .regions import RegionPlan, Selectors, find_regions, nest_plan
from .tracking import OBSERVED_CALLS, RegionTracker, drop_gone_graphs, tracking_backend
from .trampolines import CompiledForward, compiled_forward, needs_trampoline, trampoline
from .variants import find_variants

#: Where the tracker of the last ``compile_regions`` call is kept on the result's root.
TRACKER_ATTRIBUTE = "_lightning_regions_tracker"


class ApplyMode(Protocol):
    def region(self, module: nn.Module, original: nn.Module) -> nn.Module: ...

    def nested(self, module: nn.Module) -> nn.Module: ...

    def parent(self, module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module: ...


class InPlace:
    """Compile each region in place: identity, types, hooks and ``state_dict`` keys survive.

    A region whose ``forward`` is user code is compiled with ``nn.Module.compile``. For
    a torch built-in class (``nn.Linear``, ``nn.Sequential``, ``nn.TransformerEncoderLayer``
    ...) that would be a silent no-op: dynamo skips frames in ``torch.nn``, so the
    region would run eager. There the module's call goes through a small per-class
    function of ours (``trampolines``), which dynamo compiles and inlines the module through.
    A nested region is marked in place (``nested.mark_nested``).

    ``eager_hooks``: the region's ``forward`` alone is compiled and kept in its
    ``__dict__`` (``trampolines.CompiledForward``), so the module's own hooks run eager
    around it (DeepSpeed's ZeRO-3 parameter gathering); a region through a trampoline
    gets its ``forward_`` trampoline.
    """

    def __init__(
        self, compile_kwargs: dict[str, Any], tracker: RegionTracker, eager_hooks: bool = False
    ) -> None:
        self.compile_kwargs = compile_kwargs
        self.tracker = tracker
        self.eager_hooks = eager_hooks
        self.compiled_now = 0
        self.entries = own_entries(tracker.plan)

    def region(self, module: nn.Module, original: nn.Module) -> nn.Module:
        if is_compiled(module):
            return module
        variant = self.entries.get(id(original))
        if self.eager_hooks:
            cls = type(module)
            entry = cls.forward if variant is None else trampoline(cls, variant, hooks=False)
            compiled = torch.compile(entry, **self.compile_kwargs)
            vars(module)[FORWARD] = CompiledForward(module, compiled)
            self.tracker.observe(original, module.__dict__, FORWARD)
            self.compiled_now += 1
            return module
        if variant is not None:
            call = MethodType(trampoline(type(module), variant), module)
            set_compiled_call(module, torch.compile(call, **self.compile_kwargs))
        else:
            module.compile(**self.compile_kwargs)
        self.tracker.observe(original, module.__dict__, COMPILED_CALL)
        self.compiled_now += 1
        return module

    def nested(self, module: nn.Module) -> nn.Module:
        return mark_nested(module)

    def parent(self, module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
        return module


def own_entries(plan: RegionPlan) -> dict[int, int]:
    """The regions that are compiled through a trampoline (``trampolines``), by
    ``id(module)``, each with the variant whose entry it uses: torch built-in classes,
    every region of a class with several variants, and every region of a class whose
    ``forward`` code another region class of the plan shares. The others are compiled
    with ``nn.Module.compile`` (their class's ``forward`` is their entry)."""
    variants = find_variants(plan)
    codes: dict[object, set[str]] = {}
    for region in plan.regions:
        codes.setdefault(type(region.module).forward.__code__, set()).add(region.class_name)
    entries = {}
    for region in plan.regions:
        cls = type(region.module)
        several = len(variants[region.class_name].variants) > 1
        shared = len(codes[cls.forward.__code__]) > 1
        if needs_trampoline(cls) or several or shared:
            entries[id(region.module)] = (
                variants[region.class_name].variant_of(region.paths[0]) if several else 0
            )
    return entries


class OutOfPlace:
    """Wrap each region in an ``OptimizedModule``; rebuild parents, share everything else.

    A region that needs an entry of its own (``own_entries``) is called through it by its
    wrapper, as in place.

    Under ``granularity="nested"`` a nested region becomes a marked shallow copy, and a
    unit holding one (already our own copy) is compiled in place, so its keys stay.
    """

    def __init__(self, compile_kwargs: dict[str, Any], tracker: RegionTracker) -> None:
        self.compile_kwargs = compile_kwargs
        self.tracker = tracker
        self.own_copies = InPlace(compile_kwargs, tracker)

    def region(self, module: nn.Module, original: nn.Module) -> nn.Module:
        if module is not original:
            return self.own_copies.region(module, original)
        if is_compiled(module):
            return module
        compiled = cast(OptimizedModule, torch.compile(module, **self.compile_kwargs))
        variant = self.own_copies.entries.get(id(original))
        if variant is not None:  # the wrapper's call goes through the region's own entry
            call = MethodType(trampoline(type(module), variant), module)
            compiled.__dict__["forward"] = torch.compile(call, **self.compile_kwargs)
        if any(hasattr(type(module), name) for name in CONTAINER_PROTOCOL):
            compiled.__class__ = ContainerOptimizedModule
        self.tracker.observe(original, compiled.__dict__, "forward")
        return compiled

    def nested(self, module: nn.Module) -> nn.Module:
        return mark_nested(shallow_copy(module, registered_children(module)))

    def parent(self, module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
        return shallow_copy(module, children)


#: What code written against a container region uses: ``region[0]``, ``len``, ``for``.
CONTAINER_PROTOCOL = ("__getitem__", "__len__", "__iter__")


class ContainerOptimizedModule(OptimizedModule):
    """An ``OptimizedModule`` whose source is a container: indexing, ``len`` and
    iteration forward to the source, as attribute access already does."""

    @property
    def _source(self) -> Any:
        return compiled_source(self)

    def __getitem__(self, index: Any) -> Any:
        return self._source[index]

    def __len__(self) -> int:
        return len(self._source)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._source)

    def __contains__(self, item: Any) -> bool:
        return item in self._source


def is_compiled(module: nn.Module) -> bool:
    """True for an ``OptimizedModule`` or a module compiled in place (its call, or its
    forward alone)."""
    return (
        isinstance(module, OptimizedModule)
        or compiled_call(module) is not None
        or compiled_forward(module) is not None
    )


def shallow_copy(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A new module of the same class, sharing parameters and buffers, with ``children``.

    Registration dicts and sets are copied, so later changes to the copy never reach
    the source. Methods bound to the source in its ``__dict__`` are re-bound to the copy.
    """
    new = module.__class__.__new__(module.__class__)
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set)):
            value = copy.copy(value)
        elif isinstance(value, MethodType) and value.__self__ is module:
            value = MethodType(value.__func__, new)
        new.__dict__[key] = value
    set_registered_children(new, dict(children))
    return new


def apply_plan(root: nn.Module, plan: RegionPlan, mode: ApplyMode) -> nn.Module:
    """Apply ``plan`` to ``root`` in one traversal of every registration.

    Each original module maps to exactly one result, whatever number of paths reach
    it. Nested regions go through ``mode.nested``; modules with a region or nested region
    below them go through ``mode.parent`` with their mapped children, and then, if they
    are regions themselves (a unit compiled whole), through ``mode.region``; other
    regions go through ``mode.region``; every other module is kept as it is.
    """
    region_ids, nested_ids = plan.region_ids(), plan.nested_ids()
    above_regions = _ancestors_of(root, region_ids | nested_ids)
    memo: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> nn.Module:
        key = id(module)
        if key in memo:
            return memo[key]
        is_region = key in region_ids or id(unwrap(module)) in region_ids
        if key in nested_ids:
            result = mode.nested(module)
        elif key in above_regions:
            memo[key] = module  # a cycle back to this module keeps the original
            children = {
                name: None if child is None else visit(child)
                for name, child in registered_children(module).items()
            }
            result = mode.parent(module, children)
            if is_region:
                result = mode.region(result, module)
        elif is_region:
            result = mode.region(module, module)
        else:
            result = module
        memo[key] = result
        return result

    return visit(root)


def _ancestors_of(root: nn.Module, targets: set[int]) -> set[int]:
    """Ids of the modules below ``root`` (root included) with a target strictly below."""
    result: set[int] = set()
    done: set[int] = set()

    def contains_target(module: nn.Module, path: frozenset[int]) -> bool:
        key = id(module)
        if key in done:
            return key in result
        found = False
        for child in registered_children(module).values():
            if child is None or id(child) in path:
                continue
            below = contains_target(child, path | {id(child)})  # a target may hold targets
            if id(child) in targets or below:
                found = True
        done.add(key)
        if found:
            result.add(key)
        return found

    contains_target(root, frozenset({id(root)}))
    return result


def compile_regions(
    module: nn.Module,
    *,
    inplace: bool = False,
    regions: Selectors = None,
    on_compile_error: str = "raise",
    observe_calls: int | None = OBSERVED_CALLS,
    root_is_called: bool = True,
    plan: RegionPlan | None = None,
    granularity: str = "regions",
    eager_hooks: bool = False,
    **compile_kwargs: Any,
) -> nn.Module:
    """Compile the repeated blocks of ``module``, keeping its shared structure exactly.

    A drop-in for ``accelerate.utils.compile_regions``: ``compile_kwargs`` (``backend``,
    ``mode``, ``fullgraph``, ``dynamic``, ``options``...) go to ``torch.compile``.

    Out of place (default), a new tree is returned and the source is untouched:
    regions become ``OptimizedModule`` wrappers, their ancestors are shallow copies
    that share parameters and buffers, and every alias, shared block and ``None``
    child maps to one object. ``result.__dict__["_orig_mod"]`` is the source.

    In place (``inplace=True``), each distinct region is compiled with
    ``nn.Module.compile`` and ``module`` itself is returned: identity, types, hooks and
    ``state_dict`` keys do not change, and a second call compiles nothing again.

    ``regions`` takes class names and/or path globs; see ``find_regions``.
    ``on_compile_error="raise"`` (default) raises ``RegionCompileError`` naming the region
    whose graph the backend failed on; ``"eager"`` warns and runs that region eager.

    The report counts graphs and compiled calls of each region's first ``observe_calls``
    calls (``None``: until ``end_observation(result)``); after that, nothing of ours is
    on a region's call path. ``root_is_called=False`` says that nobody calls ``module``
    itself (a LightningModule under Lightning), which changes the fallback for a model
    without repeated blocks; see ``find_regions``. ``plan``: a plan already made by
    ``find_regions(module, ...)`` for this module, applied instead of planning again
    (then ``regions`` and ``root_is_called`` are not read).

    ``granularity="nested"`` compiles what runs whole instead (``module``, or with
    ``root_is_called=False`` its top-level children with parameters) and marks each
    region inside it as a torch nested compile region, so one block is traced once and
    reused; see ``nest_plan``. ``"regions"`` (default) compiles each region by itself.
    torch's limits on nested regions (a block that mutates or returns its input, one
    that differs per instance) raise ``NestedRegionError`` naming the regions and the
    fix, under either ``on_compile_error``; with inductor, buffer reuse is off in those
    graphs (``nested.NESTED_INDUCTOR_OPTIONS``: torch 2.13 computes wrong gradients
    otherwise).

    ``eager_hooks=True`` (in place, ``granularity="regions"``) compiles each region's
    ``forward`` alone, so the hooks registered on the region itself run eager around its
    compiled code: what an engine that hooks every module needs (DeepSpeed's ZeRO-3, with
    the regions made ZeRO-3 leaves so that it hooks nothing inside them).
    """
    validate_on_compile_error(on_compile_error)
    validate_granularity(granularity)
    if eager_hooks and (not inplace or granularity != "regions"):
        raise ValueError(
            f"eager_hooks=True with inplace={inplace} and granularity={granularity!r}: a "
            "region's forward is compiled in place, by itself. Pass inplace=True and "
            "granularity='regions'."
        )
    if observe_calls is not None and observe_calls < 1:
        raise ValueError(f"observe_calls={observe_calls}: use a positive count, or None.")
    if plan is None:
        plan = find_regions(module, regions, root_is_called=root_is_called)
    if granularity == "nested" and not plan.nested:
        plan = nest_plan(plan, module, root_is_called=root_is_called)
    dropped = drop_gone_graphs(plan)  # before this model's tracker is one of the live
    tracker, torch_kwargs = tracked_compile_kwargs(
        plan, compile_kwargs, on_compile_error, observe_calls
    )
    tracker.dropped = dropped
    if inplace:
        in_place = InPlace(torch_kwargs, tracker, eager_hooks)
        result = apply_plan(module, plan, in_place)
        if in_place.compiled_now == 0 and tracker_of(result) is not None:
            return result  # already compiled: keep the tracker that saw it happen
    else:
        result = apply_plan(module, plan, OutOfPlace(torch_kwargs, tracker))
        set_compiled_source(result, module)
    result.__dict__[TRACKER_ATTRIBUTE] = tracker
    return result


def tracked_compile_kwargs(
    plan: RegionPlan,
    compile_kwargs: dict[str, Any],
    on_compile_error: str = "raise",
    observe_calls: int | None = OBSERVED_CALLS,
) -> tuple[RegionTracker, dict[str, Any]]:
    """Swap the backend in ``compile_kwargs`` for a ``RegionTracker`` around it."""
    kwargs = tracked_backend_kwargs(compile_kwargs, nested=bool(plan.nested))
    tracker = RegionTracker.start(plan, kwargs["backend"], on_compile_error, observe_calls)
    return tracker, kwargs


def tracked_backend_kwargs(compile_kwargs: dict[str, Any], nested: bool = False) -> dict[str, Any]:
    """``compile_kwargs`` (``torch.compile``'s) with their backend, mode and options as the
    process's ``TrackingBackend`` around them (inductor's nested-region options added for
    a plan with ``nested`` regions)."""
    kwargs = dict(compile_kwargs)
    backend: str | Callable[..., Any] = kwargs.pop("backend", "inductor")
    mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
    validate_compile_arguments(backend, mode, options)
    if nested and backend == "inductor":
        mode, options = None, inductor_options_for_nested(mode, options)
    kwargs["backend"] = tracking_backend(backend, mode, options, kwargs.get("dynamic"))
    return kwargs


def tracker_of(module: nn.Module) -> RegionTracker | None:
    """The tracker left on ``module`` by ``compile_regions``, if any."""
    return module.__dict__.get(TRACKER_ATTRIBUTE)


def add_region_calls(module: nn.Module, name: str, compile_kwargs: dict[str, Any]) -> None:
    """Compile each region of ``module`` (compiled in place) again by ``compile_kwargs``
    (``torch.compile``'s), for training calls, and keep the result beside its compiled
    call as ``name``, to be put in place by ``use_region_calls``. Nothing compiles before
    a region runs it; calls outside training keep the first compiled call."""
    kwargs = tracked_backend_kwargs(compile_kwargs)
    for observer in _compiled_in_place(module).observers:
        observer.calls.add(name, lambda entry: torch.compile(entry, **kwargs))


def use_region_calls(module: nn.Module, name: str) -> None:
    """Run the regions ``compile_regions(module, inplace=True)`` compiled by ``name``
    (``calls.RegionCalls.use``): ``"compiled"``, ``"eager"``, ``"eager while training"``
    or a name given to ``add_region_calls``. In place: parameters, hooks and
    ``state_dict`` keys are untouched, and a call already compiled compiles nothing
    again. Ends their observation."""
    for observer in _compiled_in_place(module).observers:
        observer.end()
        observer.calls.use(name)


def _compiled_in_place(module: nn.Module) -> RegionTracker:
    """The tracker of ``module``'s regions compiled in place; ``ValueError`` if none."""
    tracker = tracker_of(module)
    if tracker is None:
        raise ValueError(f"{type(module).__name__} has no regions compiled in place.")
    return tracker


def end_observation(module: nn.Module) -> None:
    """Stop counting calls of ``module``'s regions: torch's compiled calls go back in place."""
    tracker = tracker_of(module)
    if tracker is not None:
        tracker.end_observation()
