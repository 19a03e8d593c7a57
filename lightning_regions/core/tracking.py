"""Knowing which region compiled what, and which region really ran compiled code.

Attribution is by call. While a region is observed, its call slot (an in-place region's
``_compiled_call_impl``, an out-of-place region's ``forward``) holds an
``ObservedRegion`` that marks the region as the one running. Every graph the
``TrackingBackend`` compiles meanwhile belongs to that region, and every call of a
compiled graph marks the region's call as compiled. Nothing is looked up by tensor
identity, so FSDP2's unsharded parameters, ``load_state_dict(assign=True)`` and regions
without parameters are attributed like any other.

Observation is short: the first ``observe_calls`` calls of each region, or until the
owner (a strategy) ends it. Then each region's slot gets torch's own compiled call
back, and the backend swaps each graph's counting wrapper out of the global that
dynamo installed it in, so a region call costs what ``module.compile()`` costs.

One ``TrackingBackend`` exists per distinct real backend in the process. Dynamo keys
its cache entries on the backend, so a new backend object per ``compile_regions`` call
would recompile every block class again and, after a few calls, hit
``torch._dynamo.config.recompile_limit`` and fall back to eager.
"""

from __future__ import annotations

import copy
import gc
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from ..compat import (
    COMPILED_FN_PREFIX,
    DYNAMO_WRAPPER_FRAME,
    LAZY_FORWARD,
    LazyGraphModule,
    compile_wrapper,
    current_frame_compile,
    drop_graphs,
    dynamo_graph_break_exceptions,
    dynamo_original_callable,
    dynamo_reraised_exceptions,
    graphs_held,
    recompile_limit,
)
from .calls import COMPILED, RegionCalls
from .graph import unwrap
from .nested import GraphNesting, explain_nested_failure, graph_nesting
from .regions import RegionPlan
from .trampolines import CompiledForward
from .watch import FrameCompile, FrameLog, RecompileWatch, plan_codes

CompiledFn = Callable[..., Any]
#: Calls of each region observed by ``compile_regions`` before observation ends.
OBSERVED_CALLS = 8

#: Exceptions dynamo itself re-raises from a backend call, untouched, on this torch
#: (``OutputGraph._call_user_compiler``; see ``compat.dynamo_reraised_exceptions``).
DYNAMO_RERAISES = dynamo_reraised_exceptions()
#: Exceptions dynamo turns into a graph break with a warning, as torch defines them.
DYNAMO_GRAPH_BREAKS = dynamo_graph_break_exceptions()
#: Not a region's compile failure: passed through so torch does what it does without us.
PASSED_TO_DYNAMO = DYNAMO_RERAISES + DYNAMO_GRAPH_BREAKS


class RegionCompileError(RuntimeError):
    """The backend failed on one region's graph; the region is named, the cause chained."""


class RegionCompileWarning(UserWarning):
    """A region failed to compile and runs eager (``on_compile_error="eager"``)."""


@dataclass(eq=False)
class RegionStats:
    """What one region did: graphs compiled for it, calls observed and compiled, seconds."""

    label: str = ""
    on_compile_error: str = "raise"
    graphs: int = 0
    observed_calls: int = 0
    compiled_calls: int = 0
    compile_seconds: float = 0.0
    compile_error: str | None = None
    nested_regions: tuple[str, ...] = ()  # labels of the nested regions inside this one
    #: The graphs that ran in observed calls, by compile order, for nested regions.
    ran_graphs: dict[int, GraphNesting] = field(default_factory=dict)
    class_name: str = ""
    #: Paths of every region of this region's class (they share its code, and so the
    #: graphs torch compiles for it), by region, itself included.
    class_paths: tuple[str, ...] = ()
    #: Classes whose compile failure was warned about, shared by one tracker's regions.
    warned_classes: set[str] = field(default_factory=set)
    #: The most compiled graphs one observed call ran, counting the pieces of one frame's
    #: compile as one graph: more than one means graph breaks.
    graphs_per_call: int = 0
    #: The most pieces one observed call ran: more than ``graphs_per_call`` where dynamo's
    #: DDP optimizer split a frame's graph at gradient-bucket boundaries.
    pieces_per_call: int = 0
    #: Frames torch compiled, or failed to, during the observed calls.
    frames: list[FrameCompile] = field(default_factory=list)


@dataclass(eq=False)
class _RunningRegion:
    stats: RegionStats
    graphs_ran: int = 0
    frame_compiles: set[object] = field(default_factory=set)  # of the graphs that ran


#: The observed region calls in progress, innermost last.
_RUNNING: list[_RunningRegion] = []


def _running() -> RegionStats | None:
    return _RUNNING[-1].stats if _RUNNING else None


class GraphHook:
    """One compiled graph's counting wrapper, and how to take it off the call path.

    Dynamo installs what a backend returns, wrapped by ``torch.compiler.disable``, as a
    ``__compiled_fn_*`` global of the frame it compiled. Once located, that global can
    be switched between the counting wrapper and a plain ``disable`` of the graph.
    """

    def __init__(self, compiled: CompiledFn) -> None:
        self.compiled = compiled
        self.counting: CompiledFn | None = None
        self.scope: dict[str, Any] | None = None  # None: not looked for yet; {}: not found
        self.name = ""
        self.hooked: Any = None
        self.plain: Any = None

    def locate(self, caller: FrameType | None) -> None:
        """Find the global that holds the counting wrapper, from the wrapper's caller."""
        self.scope = {}
        dynamo_wrapper = caller is not None and caller.f_code.co_name == DYNAMO_WRAPPER_FRAME
        frame = caller.f_back if caller is not None and dynamo_wrapper else None
        if frame is None:
            return
        for name, value in list(frame.f_globals.items()):
            if name.startswith(COMPILED_FN_PREFIX) and (
                dynamo_original_callable(value) is self.counting
            ):
                plain = torch.compiler.disable(self.compiled, reason="dynamo-compiled graph")
                plain._lightning_regions_hook = self  # keeps this hook alive while unhooked
                self.scope, self.name, self.hooked, self.plain = frame.f_globals, name, value, plain
                return

    def remove(self) -> None:
        if self.scope and self.scope.get(self.name) is self.hooked:
            self.scope[self.name] = self.plain

    def restore(self) -> None:
        if self.scope and self.scope.get(self.name) is self.plain:
            self.scope[self.name] = self.hooked


class TrackingBackend:
    """A ``torch.compile`` backend that attributes graphs and compiled calls to regions."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.unattributed_graphs = 0
        self.graphs_compiled = 0
        self.observers = 0
        self.hooks: weakref.WeakSet[GraphHook] = weakref.WeakSet()
        self.__name__ = str(getattr(inner, "compiler_name", "regional"))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledFn:
        owner = _running()
        start = time.perf_counter()
        try:
            compiled = self.inner(gm, example_inputs)
        except PASSED_TO_DYNAMO:
            raise  # dynamo's own control flow: a restart, a skip or a graph break
        except Exception as error:
            return _handle_compile_error(error, gm, owner)
        if owner is None:
            self.unattributed_graphs += 1
        else:
            owner.graphs += 1
            owner.compile_seconds += time.perf_counter() - start
        frame = current_frame_compile()  # one per frame compile, shared by its pieces
        return self._counting(_real_forward(compiled), graph_nesting(gm), frame)

    def _counting(
        self, compiled: CompiledFn, nesting: GraphNesting, frame: object = None
    ) -> CompiledFn:
        """Wrap ``compiled`` so a call marks the running region's call as compiled."""
        hook = GraphHook(compiled)
        backend = self
        self.graphs_compiled += 1
        number = self.graphs_compiled
        frame = number if frame is None else frame

        # Dynamo calls a backend's result with positional arguments, boxed or not.
        def run(*args: Any) -> Any:
            if hook.scope is None:
                hook.locate(sys._getframe(1))
            if backend.observers:
                if _RUNNING:
                    _RUNNING[-1].graphs_ran += 1
                    _RUNNING[-1].frame_compiles.add(frame)
                    if _RUNNING[-1].stats.nested_regions:
                        _RUNNING[-1].stats.ran_graphs[number] = nesting
            else:
                hook.remove()  # compiled after observation ended: off the path from now on
            return compiled(*args)

        hook.counting = run
        self.hooks.add(hook)
        return run

    def __deepcopy__(self, memo: dict[int, Any]) -> TrackingBackend:
        return self  # one per real backend in the process (Fabric deep-copies compile kwargs)

    def start_observing(self) -> None:
        if self.observers == 0:
            for hook in list(self.hooks):
                hook.restore()
        self.observers += 1

    def stop_observing(self) -> None:
        self.observers -= 1
        if self.observers == 0:
            for hook in list(self.hooks):
                hook.remove()

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()


def _real_forward(compiled: CompiledFn) -> CompiledFn:
    """What dynamo calls for a lazily recompiled ``GraphModule`` it can see (torch's
    ``OutputGraph.compile_and_call_fx_graph``, the same from 2.11 to 2.15): its real
    ``forward``, not ``_lazy_forward``, which checks for a pending recompile on every call.
    Our wrapper hides it, so do it here."""
    lazy = compiled if isinstance(compiled, LazyGraphModule) else None
    owner = getattr(compiled, "__self__", None)
    if isinstance(owner, LazyGraphModule) and getattr(compiled, "__name__", "") == LAZY_FORWARD:
        lazy = owner
    if lazy is None:
        return compiled
    LazyGraphModule.force_recompile(lazy)
    return compiled if compiled is lazy else lazy.forward


def _handle_compile_error(
    error: Exception, gm: torch.fx.GraphModule, owner: RegionStats | None
) -> CompiledFn:
    """Raise naming the region, or run the graph eagerly (``on_compile_error="eager"``):
    torch installs what we return for the graph, so every region of the class that
    reuses it runs eager too. One warning per class names them all."""
    if owner is None:
        raise error
    cause = f"{type(error).__name__}: {error}"
    if owner.on_compile_error == "raise" or owner.nested_regions:
        # a graph holding nested regions cannot run eager either: torch runs the same
        # higher-order op, so it is an error under both policies
        raise RegionCompileError(
            f"Compiling region {owner.label} failed: {cause}. Pass on_compile_error='eager' "
            "to run this region eager and keep training."
        ) from error
    owner.compile_error = cause
    if owner.class_name not in owner.warned_classes:
        owner.warned_classes.add(owner.class_name)
        own = owner.label.split(" at ", 1)[-1]
        others = [paths for paths in owner.class_paths if paths != own]
        reusing = (
            f", and so do the {len(others)} other {owner.class_name} region(s) that reuse "
            f"its graph: {'; '.join(others)}"
            if others
            else ""
        )
        warnings.warn(
            f"Region {owner.label} failed to compile and runs eager{reusing}. {cause}",
            RegionCompileWarning,
            stacklevel=2,
        )
    return EagerFallback(gm.forward, cause)


class EagerFallback:
    """A graph the backend failed on, run eagerly. Each observed region that runs it is
    recorded as running eager because of that failure."""

    def __init__(self, forward: CompiledFn, cause: str) -> None:
        self.forward = forward
        self.cause = cause

    def __call__(self, *args: Any) -> Any:
        if _RUNNING and _RUNNING[-1].stats.compile_error is None:
            _RUNNING[-1].stats.compile_error = self.cause
        return self.forward(*args)


def _region_compile_error(error: BaseException) -> RegionCompileError | None:
    """Our ``RegionCompileError`` inside torch's ``BackendCompilerFailed``, if it is there."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, RegionCompileError):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__
    return None


class ObservedRegion:
    """Stands in a region's call slot while the region is observed.

    ``slot[key]`` held ``call`` (torch's compiled call of the region); ``end()`` puts
    it back, so nothing of ours stays on the region's call path.
    """

    def __init__(
        self,
        stats: RegionStats,
        slot: dict[str, Any],
        key: str,
        backend: TrackingBackend,
        limit: int | None,
        frames: FrameLog,
    ) -> None:
        self.stats = stats
        self.frames = frames
        #: The region's ways to run, in its slot (``calls.RegionCalls``).
        self.calls = RegionCalls(slot, key, slot[key])
        self.limit = limit
        backend.start_observing()
        self._stop = weakref.finalize(self, backend.stop_observing)
        slot[key] = self

    @property
    def call(self) -> CompiledFn:
        """torch's compiled call of the region, which this one stands in for."""
        return self.calls.compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        running = _RunningRegion(self.stats)
        if not _RUNNING:
            self.frames.new_frames()  # what compiled before this call is not this region's
        _RUNNING.append(running)
        try:
            return self.call(*args, **kwargs)
        except Exception as error:
            if self.stats.nested_regions:
                labels = list(self.stats.nested_regions)
                explained = explain_nested_failure(error, self.stats.label, labels)
                if explained is not None:
                    raise explained from error
            ours = _region_compile_error(error)
            if ours is not None and ours is not error:
                # torch wraps what the backend raised in BackendCompilerFailed: the user
                # gets ours, with the backend's own error as its cause
                raise RegionCompileError(str(ours)) from ours.__cause__
            raise
        finally:
            _RUNNING.pop()
            self.stats.observed_calls += 1
            self.stats.compiled_calls += running.graphs_ran > 0
            frames_ran = len(running.frame_compiles)
            self.stats.graphs_per_call = max(self.stats.graphs_per_call, frames_ran)
            self.stats.pieces_per_call = max(self.stats.pieces_per_call, running.graphs_ran)
            self.stats.frames.extend(self.frames.new_frames())
            if self.limit is not None and self.stats.observed_calls >= self.limit:
                self.end()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # a copy is not observed: a compiled forward copies as the plain one; torch's
        # compiled call in this slot is shared, as torch's own copy would share it
        if isinstance(self.call, CompiledForward):
            return copy.deepcopy(self.call, memo)
        return self

    def __reduce__(self) -> str | tuple[Any, ...]:
        """A compiled forward is saved as the plain one, observed or not."""
        if isinstance(self.call, CompiledForward):
            return self.call.__reduce__()
        return super().__reduce__()

    def end(self) -> None:
        calls = self.calls
        if calls.slot.get(calls.key) is self:
            calls.use(COMPILED)
        self._stop()  # runs once


_BACKENDS: list[TrackingBackend] = []


def tracking_backend(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
) -> TrackingBackend:
    """The process-wide tracking backend around what ``torch.compile`` would build."""
    inner = compile_wrapper(backend, mode, options, dynamic)
    for existing in _BACKENDS:
        if existing.inner == inner:
            return existing
    _BACKENDS.append(TrackingBackend(inner))
    return _BACKENDS[-1]


@dataclass(eq=False)
class RegionTracker:
    """One ``compile_regions`` call: its plan, each region's stats, its recompiles."""

    plan: RegionPlan
    stats: list[RegionStats]
    backend: TrackingBackend
    watch: RecompileWatch
    observe_calls: int | None = OBSERVED_CALLS
    observers: list[ObservedRegion] = field(default_factory=list)
    frames: FrameLog = field(default_factory=FrameLog)
    #: The keep-or-revert gate's outcome for these regions: the gate's own object (its
    #: decision, or why there is none), set by the gate alone; its ``str`` is the line.
    gate_outcome: object | None = None
    #: Graphs of models no longer alive dropped before compiling (``drop_gone_graphs``).
    dropped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        regions = self.plan.regions
        self._stats_by_module = {
            id(region.module): stats for region, stats in zip(regions, self.stats, strict=True)
        }
        LIVE_TRACKERS.add(self)

    @classmethod
    def start(
        cls,
        plan: RegionPlan,
        backend: TrackingBackend,
        on_compile_error: str = "raise",
        observe_calls: int | None = OBSERVED_CALLS,
    ) -> RegionTracker:
        by_class: dict[str, list[str]] = {}
        for region in plan.regions:
            by_class.setdefault(region.class_name, []).append(", ".join(region.paths))
        warned_classes: set[str] = set()
        stats = [
            RegionStats(
                region.label,
                on_compile_error,
                nested_regions=tuple(nested.label for nested in plan.nested_in(region)),
                class_name=region.class_name,
                class_paths=tuple(by_class[region.class_name]),
                warned_classes=warned_classes,
            )
            for region in plan.regions
        ]
        return cls(plan, stats, backend, RecompileWatch(plan), observe_calls)

    def observe(self, module: nn.Module, slot: dict[str, Any], key: str) -> None:
        """Observe region ``module``, whose compiled call is ``slot[key]``."""
        stats = self._stats_by_module[id(unwrap(module))]
        self.observers.append(
            ObservedRegion(stats, slot, key, self.backend, self.observe_calls, self.frames)
        )

    def end_observation(self) -> None:
        """Put torch's compiled calls back in every region; counts stop here."""
        for observer in self.observers:
            observer.end()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied as ``None``, with builtins only: torch drops a module's
        compiled call when it is saved or copied, so the copy is a plain model with
        nothing to report, and loading it needs no lightning_regions."""
        return (dict.get, ({}, None))


#: Every ``RegionTracker`` not yet collected: one per model compiled and still alive (a
#: model and its tracker form a cycle, gone at a garbage collection).
LIVE_TRACKERS: weakref.WeakSet[RegionTracker] = weakref.WeakSet()


def drop_gone_graphs(plan: RegionPlan) -> tuple[str, ...]:
    """Drop the graphs dynamo holds for ``plan``'s region code where they fill half of
    torch's ``recompile_limit`` or more and no model compiled by us that runs that code
    is alive: a sweep's or a notebook's earlier models of the same class, at other
    widths, whose graphs would otherwise count against this model's limit until it ran
    eager (4 widths of a block compiled 2 ways fill the 8 of torch's default). Graphs
    that a live model may still run are kept, and so are fewer: a rerun of the same
    shapes reuses them. Returns what was dropped (``"Block.forward: 8 graph(s)"``)."""
    crowded = [code for code in plan_codes(plan) if 2 * graphs_held(code) >= recompile_limit()]
    if not crowded:
        return ()
    gc.collect()  # the gone models' trackers, in cycles with their models
    live = {code for tracker in list(LIVE_TRACKERS) for code in plan_codes(tracker.plan)}
    dropped = []
    for code in sorted(crowded, key=lambda code: code.co_qualname):
        if code not in live:
            dropped.append(f"{code.co_qualname}: {graphs_held(code)} graph(s)")
            drop_graphs(code)
    return tuple(dropped)
