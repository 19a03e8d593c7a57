"""What happened, for people: regions, aliases kept, graphs, calls, seconds.

``region_report(model)`` reads the tracker that ``compile_regions`` left on the model
and returns plain data that tests and benchmarks use; ``str()`` of it is the table the
strategy logs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

from .compile import tracker_of
from .watch import ClassRecompiles, graph_breaks


class RegionNotCompiledWarning(UserWarning):
    """A region was meant to run compiled but no compiled call of it was seen."""


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


@dataclass(frozen=True)
class RegionReport:
    """Regions with their counts, plus the aliases and ties of the compiled model."""

    rows: tuple[RegionRow, ...]
    alias_groups: tuple[tuple[str, ...], ...]
    tie_groups: tuple[tuple[str, ...], ...]
    whole_model: bool
    recompiles: tuple[ClassRecompiles, ...] = ()
    graph_breaks: int = 0

    @property
    def graphs(self) -> int:
        return sum(row.graphs for row in self.rows)

    @property
    def compile_seconds(self) -> float:
        return sum(row.compile_seconds for row in self.rows)

    @property
    def never_ran_compiled(self) -> tuple[RegionRow, ...]:
        """Regions with no compiled call: they ran eager, or were never called."""
        return tuple(row for row in self.rows if row.compiled_calls == 0)

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
                    f"(recompile-limit hits {entry.limit_hits}); last reason: {entry.reasons[-1]}"
                )
        lines.append(f"  aliases kept: {_groups(self.alias_groups)}")
        lines.append(f"  tied parameters kept: {_groups(self.tie_groups)}")
        return "\n".join(lines)


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
    )
    return RegionReport(
        rows=rows,
        alias_groups=tuple(plan.graph.own_alias_groups()),
        tie_groups=tuple(plan.graph.own_tie_groups()),
        whole_model=plan.whole_model,
        recompiles=tuple(tracker.watch.refresh()),
        graph_breaks=graph_breaks(),
    )


def warn_if_not_compiled(report: RegionReport) -> None:
    """Warn, naming each region, when a region never ran compiled code."""
    missing = report.never_ran_compiled
    if missing:
        names = "; ".join(f"{row.class_name} at {', '.join(row.paths)}" for row in missing)
        warnings.warn(
            f"{len(missing)} region(s) never ran compiled code in their observed calls "
            f"(eager fallback, a skipped frame, or never called): {names}",
            RegionNotCompiledWarning,
            stacklevel=2,
        )
