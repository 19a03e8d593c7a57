"""What happened, for people: regions, aliases kept, graphs, calls, seconds.

``region_report(model)`` reads the tracker that ``compile_regions`` left on the model
and returns plain data that tests and benchmarks use; ``str()`` of it is the table the
strategy logs. It assembles and formats only: every judgement (what is wrong, what is
bounded, what fixes it) is ``judge.py``'s and ``pieces.py``'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

from ..compat import compile_turned_off
from ..core.compile import tracker_of
from ..core.graph import compress_paths, join
from ..core.regions import Region, RegionPlan
from ..core.tracking import RegionStats
from ..core.variants import ClassVariants, find_variants
from ..core.watch import ClassRecompiles, FrameCompile, graph_breaks, parse_guard
from .judge import (
    ClassRun,
    LimitFilledByOthers,
    PerInstanceRecompiles,
    judge_limit_filled,
    judge_nested_traced,
    judge_recompiles,
    uncontrolled_kv_caches,
)
from .pieces import DDPSplit, RegionFrames, RegionGraphBreaks, find_ddp_splits, find_graph_breaks


class RegionNotCompiledWarning(UserWarning):
    """A region was meant to run compiled but no compiled call of it was seen."""


class PerInstanceRecompileWarning(UserWarning):
    """Instances of one block class compiled graphs of their own beyond the class's
    variants, so the compile grows with depth, or some were left eager."""


class RegionGraphBreakWarning(UserWarning):
    """A region class's calls run in pieces: part of each block runs eager."""


@dataclass(frozen=True)
class RegionRow:
    class_name: str
    paths: tuple[str, ...]
    reason: str
    graphs: int
    observed_calls: int
    compiled_calls: int
    compile_seconds: float
    compile_error: str | None = None
    nested_in: str = ""  # a nested region: the path of the unit compiled whole around it
    nested_calls: int = 0  # its calls inside that unit's compiled graphs
    nested_subgraphs: int = 0  # distinct traced blocks those calls ran
    nested_reuses: int = 0  # calls that ran a block already traced, not a new trace
    inlined: bool = False  # torch traced a call of it into the unit's graph, not nested
    graphs_per_call: int = 0  # the most compiled graphs one observed call ran
    pieces_per_call: int = 0  # the most pieces of them (DDP's split makes several of one)
    frames: tuple[FrameCompile, ...] = ()  # torch's frame compiles during the observed calls

    @property
    def ran_compiled(self) -> bool:
        if self.nested_in:
            return self.nested_calls > 0 or self.inlined
        return self.compiled_calls > 0

    @property
    def called(self) -> bool:
        """Called in the observed calls (a nested region: its unit was)."""
        return self.observed_calls > 0 or bool(self.nested_in)

    @property
    def fell_back(self) -> bool:
        """Called, never ran compiled code, and not because its compile failed
        (``RegionCompileWarning`` names those): an eager fallback or a skipped frame."""
        return self.called and not self.ran_compiled and not self.compile_error


@dataclass(frozen=True)
class RegionReport:
    """Regions with their counts, plus the aliases and ties of the compiled model."""

    rows: tuple[RegionRow, ...]
    alias_groups: tuple[tuple[str, ...], ...]
    tie_groups: tuple[tuple[str, ...], ...]
    whole_model: bool
    recompiles: tuple[ClassRecompiles, ...] = ()
    graph_breaks: int = 0
    per_instance: tuple[PerInstanceRecompiles, ...] = ()
    variants: tuple[ClassVariants, ...] = ()  # classes of more than one variant
    breaks: tuple[RegionGraphBreaks, ...] = ()  # classes whose calls ran in pieces
    ddp_split: tuple[DDPSplit, ...] = ()  # classes whose graph DDP's optimizer split
    #: The keep-or-revert gate's outcome (``RegionTracker.gate_outcome``), once it has one.
    gate_outcome: object | None = None
    #: Graphs of models no longer alive dropped before compiling (``drop_gone_graphs``).
    dropped: tuple[str, ...] = ()
    #: Region classes that ran eager because their code already held torch's
    #: ``recompile_limit`` in graphs compiled for other live models: (class, graphs held).
    limit_filled_before: tuple[LimitFilledByOthers, ...] = ()
    #: How torch.compile is turned off in this process ('' where it is not).
    compile_off: str = ""

    @property
    def graphs(self) -> int:
        return sum(row.graphs for row in self.rows)

    @property
    def compile_seconds(self) -> float:
        return sum(row.compile_seconds for row in self.rows)

    @property
    def never_ran_compiled(self) -> tuple[RegionRow, ...]:
        """Regions with no compiled call (a nested region: no call in a compiled graph):
        they ran eager, or were never called."""
        return tuple(row for row in self.rows if not row.ran_compiled)

    @property
    def ran_eager(self) -> tuple[RegionRow, ...]:
        """Regions called in the observed calls that never ran compiled code."""
        return tuple(row for row in self.rows if row.called and not row.ran_compiled)

    @property
    def never_called(self) -> tuple[RegionRow, ...]:
        """Regions the observed calls never called: nothing was lost there (a text-only
        step leaves vision or cross-attention layers alone)."""
        return tuple(row for row in self.rows if not row.called)

    @property
    def warned_per_instance(self) -> tuple[PerInstanceRecompiles, ...]:
        """Per-instance recompiles that grow with depth or left regions eager."""
        return tuple(entry for entry in self.per_instance if not entry.bounded)

    @property
    def nested(self) -> tuple[RegionRow, ...]:
        """The regions that ran as nested compile regions (``granularity="nested"``)."""
        return tuple(row for row in self.rows if row.nested_in)

    def __str__(self) -> str:
        lines = [
            f"regional compile: {len(self.rows)} region(s), {self.graphs} graph(s), "
            f"{self.compile_seconds:.2f}s in the backend"
            + (" [whole model: no repeated blocks]" if self.whole_model else "")
        ]
        started = any(row.observed_calls or row.graphs for row in self.rows)
        for row in self.rows:
            if not started:
                status = "not run yet"
            elif row.nested_in:
                status = (
                    f"nested in {row.nested_in}: {row.nested_calls} call(s) in graph, "
                    f"{row.nested_subgraphs} traced, {row.nested_reuses} reused"
                    if row.nested_calls
                    else f"compiled inline in {row.nested_in} (torch did not nest its call)"
                    if row.inlined
                    else f"NOT COMPILED (no call in a compiled graph of {row.nested_in})"
                )
            elif row.compile_error:
                status = f"EAGER (compile failed: {row.compile_error})"
            elif row.observed_calls == 0:
                status = "not called"
            elif row.compiled_calls == 0:
                status = f"EAGER (no compiled call in {row.observed_calls} observed)"
            elif row.compiled_calls < row.observed_calls:
                status = f"compiled in {row.compiled_calls} of {row.observed_calls} observed calls"
            else:
                status = "compiled"
            lines.append(
                f"  {row.class_name:<16} graphs={row.graphs} calls={row.compiled_calls} "
                f"{status}  paths={', '.join(row.paths)}  ({row.reason})"
            )
        for entry in self.recompiles:
            if entry.recompiles or entry.limit_hits:
                lines.append(
                    f"  recompiles of {entry.class_name}: {entry.recompiles} "
                    f"(recompile-limit hits {entry.limit_hits}); last guard: "
                    f"{parse_guard(entry.reasons[-1]) if entry.reasons else 'none recorded'}"
                )
        for class_name, (calls, traced, reused) in _nested_by_class(self.nested).items():
            lines.append(
                f"  nested {class_name}: {calls} call(s) in graph, {traced} traced, {reused} reused"
            )
        for variants in self.variants:
            lines.append(f"  variants of {variants}")
        for judged in self.per_instance:
            label = "graphs of" if judged.bounded else "PER-INSTANCE RECOMPILES:"
            lines.append(f"  {label} {judged}")
        for split in self.breaks:
            lines.append(f"  GRAPH BREAKS in {split}")
        for pieces in self.ddp_split:
            lines.append(f"  compiled in pieces: {pieces}")
        if self.gate_outcome is not None:
            lines.append(f"  on this run's steps: {self.gate_outcome}")
        if self.compile_off:
            lines.append(
                f"  torch.compile is turned off in this process ({self.compile_off}): "
                "every region runs eager"
            )
        if self.dropped:
            lines.append(
                "  dropped before compiling, graphs of models of these classes no longer "
                f"alive (they counted against torch's recompile limit): {'; '.join(self.dropped)}"
            )
        lines.append(f"  aliases kept: {_groups(self.alias_groups)}")
        lines.append(f"  tied parameters kept: {_groups(self.tie_groups)}")
        return "\n".join(lines)


def _nested_by_class(rows: tuple[RegionRow, ...]) -> dict[str, tuple[int, int, int]]:
    totals: dict[str, tuple[int, int, int]] = {}
    for row in rows:
        calls, traced, reused = totals.get(row.class_name, (0, 0, 0))
        totals[row.class_name] = (
            calls + row.nested_calls,
            traced + row.nested_calls - row.nested_reuses,
            reused + row.nested_reuses,
        )
    return totals


def _groups(groups: tuple[tuple[str, ...], ...]) -> str:
    if not groups:
        return "none"
    return "; ".join(" = ".join(path or "<root>" for path in group) for group in groups)


def region_report(model: nn.Module) -> RegionReport:
    """The report for a model returned by ``compile_regions`` (either mode)."""
    tracker = tracker_of(model)
    if tracker is None:
        raise ValueError(
            f"{type(model).__name__} was not compiled by lightning_regions.compile_regions."
        )
    plan = tracker.plan
    rows = tuple(
        RegionRow(
            class_name=region.class_name,
            paths=region.paths,
            reason=region.reason,
            graphs=stats.graphs,
            observed_calls=stats.observed_calls,
            compiled_calls=stats.compiled_calls,
            compile_seconds=stats.compile_seconds,
            compile_error=stats.compile_error,
            graphs_per_call=stats.graphs_per_call,
            pieces_per_call=stats.pieces_per_call,
            frames=tuple(stats.frames),
        )
        for region, stats in zip(plan.regions, tracker.stats, strict=True)
    ) + nested_rows(plan, tracker.stats)
    recompiles = tuple(tracker.watch.refresh())
    variants = find_variants(plan)
    regional = [row for row in rows if not row.nested_in]
    frames = [
        RegionFrames(r.class_name, r.paths[0], r.graphs_per_call, r.frames, r.pieces_per_call)
        for r in regional
    ]
    compile_off = compile_turned_off()
    filled = () if compile_off else limit_filled_before(plan, regional)
    filled_classes = {class_name for class_name, _held in filled}
    # nothing is judged per instance where nothing compiles in this process
    per_instance = () if compile_off else per_instance_recompiles(rows, recompiles, variants, plan)
    return RegionReport(
        rows=rows,
        alias_groups=tuple(plan.graph.own_alias_groups()),
        tie_groups=tuple(plan.graph.own_tie_groups()),
        whole_model=plan.whole_model,
        recompiles=recompiles,
        graph_breaks=graph_breaks(),
        per_instance=tuple(
            judged
            for judged in per_instance
            if judged.class_name not in filled_classes  # not per instance: the limit was full
        )
        + nested_traced_apart(rows),
        variants=tuple(v for v in variants.values() if len(v.variants) > 1),
        breaks=find_graph_breaks(frames),
        ddp_split=find_ddp_splits(frames),
        gate_outcome=tracker.gate_outcome,
        dropped=tracker.dropped,
        limit_filled_before=filled,
        compile_off=compile_off,
    )


def limit_filled_before(plan: RegionPlan, rows: list[RegionRow]) -> tuple[LimitFilledByOthers, ...]:
    """The region classes that fell back to eager because graphs of other live models
    filled torch's recompile limit for their code (``judge.judge_limit_filled``, on
    these rows' graphs per class)."""
    graphs_by_class: dict[str, int] = {}
    for row in rows:
        graphs_by_class[row.class_name] = graphs_by_class.get(row.class_name, 0) + row.graphs
    fell_back = {row.class_name for row in rows if row.fell_back}
    return judge_limit_filled(plan, graphs_by_class, fell_back)


def per_instance_recompiles(
    rows: tuple[RegionRow, ...],
    recompiles: tuple[ClassRecompiles, ...],
    variants: dict[str, ClassVariants],
    plan: RegionPlan,
) -> tuple[PerInstanceRecompiles, ...]:
    """Each region class whose instances compiled graphs of their own, judged against its
    variants (``diagnosis.judge_recompiles``)."""
    by_class: dict[str, list[RegionRow]] = {}
    for row in rows:
        if not row.nested_in:
            by_class.setdefault(row.class_name, []).append(row)
    reasons = {entry.class_name: entry for entry in recompiles}
    uncontrolled = uncontrolled_kv_caches(plan.graph.modules[""])
    classes = tuple(dict.fromkeys(row.class_name for row in rows if not row.nested_in))
    found = []
    for class_name, class_rows in by_class.items():
        entry = reasons.get(class_name)
        run = ClassRun(
            class_name=class_name,
            paths=tuple(row.paths[0] for row in class_rows),
            graphs=tuple(row.graphs for row in class_rows),
            eager=sum(row.fell_back for row in class_rows),
            reasons=tuple(entry.reasons) if entry else (),
            limit_hits=entry.limit_hits if entry else 0,
        )
        others = tuple(name for name in classes if name != class_name)
        judged = judge_recompiles(run, variants.get(class_name), uncontrolled, others)
        if judged is not None:
            found.append(judged)
    return tuple(found)


def nested_rows(plan: RegionPlan, stats: list[RegionStats]) -> tuple[RegionRow, ...]:
    """One row per nested region: its calls in the compiled graphs that ran for the unit
    around it (found by the module path dynamo recorded for each call), how many of
    those calls traced a new block and how many reused one, and whether torch inlined
    a call of it into the unit's graph instead."""
    rows = []
    held = [{id(inside.module) for inside in plan.nested_in(unit)} for unit in plan.regions]
    for nested in plan.nested:
        unit_path, calls, subgraphs, reuses, inlined = "", 0, set(), 0, False
        for unit, unit_stats, inside in zip(plan.regions, stats, held, strict=True):
            if id(nested.module) not in inside:
                continue
            unit_path = unit_path or (unit.paths[0] or "<root>")
            for number, nesting in sorted(unit_stats.ran_graphs.items()):
                traced: set[str] = set()
                for call in nesting.calls:
                    if _names(nested, unit, call.path):
                        calls += 1
                        subgraphs.add((number, call.subgraph))
                        reuses += call.subgraph in traced
                    traced.add(call.subgraph)
                inlined = inlined or any(
                    _names(nested, unit, path) for path in nesting.module_paths
                )
        rows.append(
            RegionRow(
                class_name=nested.class_name,
                paths=nested.paths,
                reason=nested.reason,
                graphs=0,
                observed_calls=0,
                compiled_calls=0,
                compile_seconds=0.0,
                nested_in=unit_path,
                nested_calls=calls,
                nested_subgraphs=len(subgraphs),
                nested_reuses=reuses,
                inlined=inlined,
            )
        )
    return tuple(rows)


def _names(nested: Region, unit: Region, path: str) -> bool:
    """True when ``path``, relative to ``unit``, is a path of ``nested``."""
    return any(join(prefix, path) in nested.paths for prefix in unit.paths)


def nested_traced_apart(rows: tuple[RegionRow, ...]) -> tuple[PerInstanceRecompiles, ...]:
    """Each nested region class judged on how many instances traced a block of their
    own (``diagnosis.judge_nested_traced``)."""
    found = []
    nested = tuple(row for row in rows if row.nested_in)
    for class_name, (_calls, traced, _reused) in _nested_by_class(nested).items():
        instances = sum(1 for row in nested if row.class_name == class_name)
        judged = judge_nested_traced(class_name, instances, traced)
        if judged is not None:
            found.append(judged)
    return tuple(found)


def warn_about(report: RegionReport) -> None:
    """Every warning the report calls for, as the strategies give them after the first
    step: per-instance recompiles that grow, graph breaks inside regions, regions that
    ran eager."""
    warn_per_instance_recompiles(report)
    warn_graph_breaks(report)
    warn_if_not_compiled(report)


def warn_per_instance_recompiles(report: RegionReport) -> None:
    """Warn, naming the class, the guard and the fix, for each class whose per-instance
    recompiles grow with depth or left regions eager (bounded ones are only reported)."""
    for entry in report.warned_per_instance:
        warnings.warn(
            f"Regional compile recompiles per instance: {entry}",
            PerInstanceRecompileWarning,
            stacklevel=2,
        )


def warn_graph_breaks(report: RegionReport) -> None:
    """Warn, once per class, naming torch's reasons, what runs eager and the fix, for
    each region class whose calls ran in pieces."""
    for entry in report.breaks:
        warnings.warn(
            f"Graph breaks inside regions: {entry}",
            RegionGraphBreakWarning,
            stacklevel=2,
        )


def warn_if_not_compiled(report: RegionReport) -> None:
    """Warn, naming each region, when a region that was called never ran compiled code.
    Regions that failed to compile are left out (``RegionCompileWarning`` named them when
    it happened), and so are regions never called: nothing was lost there."""
    filled = {judged.class_name: judged for judged in report.limit_filled_before}
    missing = tuple(row for row in report.rows if row.fell_back)
    if missing and report.compile_off:
        warnings.warn(
            f"{len(missing)} region(s) ran eager: torch.compile is turned off in this "
            f"process ({report.compile_off}), as for any torch.compile. Turn it back on to "
            f"compile them: {compress_paths(row.paths[0] for row in missing)}",
            RegionNotCompiledWarning,
            stacklevel=2,
        )
        return
    unexplained = tuple(row for row in missing if row.class_name not in filled)
    if unexplained:
        names = "; ".join(f"{row.class_name} at {', '.join(row.paths)}" for row in unexplained)
        warnings.warn(
            f"{len(unexplained)} region(s) were called but never ran compiled code in their "
            f"observed calls (an eager fallback or a skipped frame): {names}",
            RegionNotCompiledWarning,
            stacklevel=2,
        )
    for class_name, judged in filled.items():
        paths = compress_paths(row.paths[0] for row in missing if row.class_name == class_name)
        warnings.warn(
            f"{class_name} at {paths} ran eager: {judged.fix()}",
            RegionNotCompiledWarning,
            stacklevel=2,
        )
