"""What happened, for people: regions, aliases kept, graphs, calls, seconds.

``region_report(model)`` reads the tracker that ``compile_regions`` left on the model
and returns plain data that tests and benchmarks use; ``str()`` of it is the table the
strategy logs.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from torch import nn

from .compat import dynamo_config
from .compile import tracker_of
from .graph import join
from .nested import NESTED_TRACED_APART_FIX
from .regions import Region, RegionPlan
from .tracking import RegionStats
from .watch import ClassRecompiles, Guard, graph_breaks, parse_guard


class RegionNotCompiledWarning(UserWarning):
    """A region was meant to run compiled but no compiled call of it was seen."""


class PerInstanceRecompileWarning(UserWarning):
    """Instances of one block class compiled graphs of their own: a guard differs per instance."""


#: Up to this many instances compiling graphs of their own is torch compiling a
#: per-instance number as a constant once and then as a symbolic value: bounded, 2
#: graphs whatever the depth. More (or a recompile-limit hit) grows with depth.
SYMBOLIC_AFTER_FIRST_CHANGE = 2


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

    @property
    def ran_compiled(self) -> bool:
        if self.nested_in:
            return self.nested_calls > 0 or self.inlined
        return self.compiled_calls > 0


@dataclass(frozen=True)
class PerInstanceRecompiles:
    """One block class whose instances compiled graphs of their own, and why."""

    class_name: str
    instances: int
    instances_compiled: int
    instances_eager: int
    graphs: int
    limit_hits: int
    guards: tuple[Guard, ...]
    fix: str
    nested: bool = False  # nested regions traced apart, not graphs compiled apart

    def __str__(self) -> str:
        if self.nested:
            return (
                f"nested {self.class_name}: {self.graphs} of {self.instances} instances traced a "
                "block of their own instead of reusing one, so the compile grows with depth "
                f"(torch records no guard for it). Fix: {self.fix}"
            )
        eager = (
            f", {self.instances_eager} left eager (recompile-limit hits {self.limit_hits})"
            if self.instances_eager or self.limit_hits
            else ""
        )
        guards = "; ".join(str(guard) for guard in self.guards) or "not recorded by torch"
        return (
            f"{self.class_name}: {self.graphs} graph(s) from {self.instances_compiled} of "
            f"{self.instances} instances{eager}. Guard that differs per instance: {guards}. "
            f"Fix: {self.fix}"
        )


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
                status = "NEVER CALLED"
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
        for entry in self.per_instance:
            lines.append(f"  PER-INSTANCE RECOMPILES: {entry}")
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
        )
        for region, stats in zip(plan.regions, tracker.stats, strict=True)
    ) + nested_rows(plan, tracker.stats)
    recompiles = tuple(tracker.watch.refresh())
    return RegionReport(
        rows=rows,
        alias_groups=tuple(plan.graph.own_alias_groups()),
        tie_groups=tuple(plan.graph.own_tie_groups()),
        whole_model=plan.whole_model,
        recompiles=recompiles,
        graph_breaks=graph_breaks(),
        per_instance=per_instance_recompiles(rows, recompiles) + nested_traced_apart(rows),
    )


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


def per_instance_recompiles(
    rows: tuple[RegionRow, ...], recompiles: tuple[ClassRecompiles, ...]
) -> tuple[PerInstanceRecompiles, ...]:
    """Block classes of which two or more instances compiled graphs of their own, or
    which hit the recompile limit, for a reason other than a tensor input's metadata;
    with the guards that differed (dynamo's recompile reasons) and the fix for each."""
    by_class: dict[str, list[RegionRow]] = {}
    for row in rows:
        by_class.setdefault(row.class_name, []).append(row)
    reasons = {entry.class_name: entry for entry in recompiles}
    found = []
    for class_name, class_rows in by_class.items():
        entry = reasons.get(class_name)
        guards = _distinct_guards(entry.reasons if entry else [])
        compiled = [row for row in class_rows if row.graphs > 0]
        limit_hits = entry.limit_hits if entry else 0
        if not guards or (len(compiled) < 2 and not limit_hits):
            continue
        bounded = len(compiled) <= SYMBOLIC_AFTER_FIRST_CHANGE and not limit_hits
        found.append(
            PerInstanceRecompiles(
                class_name=class_name,
                instances=len(class_rows),
                instances_compiled=len(compiled),
                instances_eager=sum(
                    1 for row in class_rows if row.observed_calls and not row.compiled_calls
                ),
                graphs=sum(row.graphs for row in class_rows),
                limit_hits=limit_hits,
                guards=guards,
                fix=fix_for(guards[0], bounded),
            )
        )
    return tuple(found)


def nested_traced_apart(rows: tuple[RegionRow, ...]) -> tuple[PerInstanceRecompiles, ...]:
    """Nested region classes of which more instances traced a block of their own than
    torch's symbolic-after-first-change bound: torch without a reuse limit
    (``compat.NESTED_REUSE_LIMIT``) traces every instance whose guards differ."""
    found = []
    for class_name, (_calls, traced, _reused) in _nested_by_class(
        tuple(row for row in rows if row.nested_in)
    ).items():
        if traced > SYMBOLIC_AFTER_FIRST_CHANGE:
            instances = sum(1 for row in rows if row.nested_in and row.class_name == class_name)
            found.append(
                PerInstanceRecompiles(
                    class_name=class_name,
                    instances=instances,
                    instances_compiled=traced,
                    instances_eager=0,
                    graphs=traced,
                    limit_hits=0,
                    guards=(),
                    fix=NESTED_TRACED_APART_FIX,
                    nested=True,
                )
            )
    return tuple(found)


def _distinct_guards(reasons: list[str]) -> tuple[Guard, ...]:
    """Guards not on a tensor input, one per shape (``layers[7]`` and ``layers[6]`` are one)."""
    distinct: dict[str, Guard] = {}
    for reason in reasons:
        guard = parse_guard(reason)
        if guard.expression and not guard.on_input_tensor:
            distinct.setdefault(re.sub(r"\d+", "N", guard.expression), guard)
    return tuple(distinct.values())


def fix_for(guard: Guard, bounded: bool = False) -> str:
    """What removes a per-instance guard of this kind. ``bounded``: torch already
    compiled the value symbolic after the first change (2 graphs whatever the depth)."""
    text = f"{guard.expression} {guard.source} {guard.location}"
    if "cache_utils" in text or "past_key_value" in text or "use_cache" in text:
        return (
            "a transformers KV cache is built in training (config.use_cache=True) and each "
            "layer indexes it by its layer_idx. The strategies turn it off where not asked "
            "for (disable_training_kv_cache=True, the default); elsewhere pass use_cache=False."
        )
    if "___check_type_id" in text or "___check_obj_id" in text:
        return (
            "an attribute whose object or class differs per instance; give every instance "
            "the same object and class, or choose outside forward."
        )
    number = re.fullmatch(r"self(\.\w+)+ == (-?[\d.e+-]+)", guard.expression)
    if number and bounded:
        return (
            "a per-instance number: torch compiled its first value as a constant and the "
            "next as symbolic, so this class costs 2 compiles whatever the depth. Store it "
            "as a tensor buffer (register_buffer) for one graph."
        )
    if number and re.fullmatch(r"-?\d+", number.group(2)):
        return (
            "a per-instance int attribute. unspecialize_module_ints=True (the strategies' "
            "default; torch._dynamo.config.allow_unspec_int_on_nn_module) compiles it as a "
            "symbolic int after the first change; or store it as a tensor buffer."
        )
    if number and dynamo_config().specialize_float:
        return (
            "a per-instance float attribute, specialised because "
            "torch._dynamo.config.specialize_float is True; set it False (torch's default) "
            "or store the value as a tensor buffer."
        )
    if number:
        return (
            "a per-instance float attribute that torch specialised (it could not keep it "
            "symbolic in this forward); store the value as a tensor buffer, or make it the "
            "same on every instance."
        )
    return (
        "make the attribute the guard reads the same on every instance, or pass it to "
        "forward as a tensor."
    )


def warn_per_instance_recompiles(report: RegionReport) -> None:
    """Warn, naming the class, the guard and the fix, for each per-instance recompile."""
    for entry in report.per_instance:
        warnings.warn(
            f"Regional compile recompiles per instance: {entry}",
            PerInstanceRecompileWarning,
            stacklevel=2,
        )


def warn_if_not_compiled(report: RegionReport) -> None:
    """Warn, naming each region, when a region never ran compiled code. Regions that
    failed to compile are left out: ``RegionCompileWarning`` named them when it happened."""
    missing = tuple(row for row in report.never_ran_compiled if not row.compile_error)
    if missing:
        names = "; ".join(f"{row.class_name} at {', '.join(row.paths)}" for row in missing)
        warnings.warn(
            f"{len(missing)} region(s) never ran compiled code in their observed calls "
            f"(eager fallback, a skipped frame, or never called): {names}",
            RegionNotCompiledWarning,
            stacklevel=2,
        )
