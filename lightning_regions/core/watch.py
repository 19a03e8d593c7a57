"""Recompiles, recompile-limit hits and graph breaks, from torch's own records.

Dynamo records one ``CompilationMetrics`` entry per frame compile
(``torch._dynamo.utils.get_compilation_metrics()``), with the code object's name,
file and line, the guard failure that caused a recompile (``recompile_reason``) and
why a compile failed (``fail_reason``). All regions of one class share that class's
code (``forward``, or our per-class trampoline for torch built-ins), so counts are per
block class. ``RecompileWatch`` keeps a running tally, since torch keeps only the last
64 entries.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from torch import nn

from ..compat import dynamo_counters, get_compilation_metrics
from .graph import unwrap
from .regions import RegionPlan
from .trampolines import existing_trampolines

CodeKey = tuple[str, str, int]


class RecompileStormWarning(UserWarning):
    """A block class recompiled at least ``recompile_warn_threshold`` times."""


@dataclass
class ClassRecompiles:
    """Recompiles of one block class's code, with torch's stated reasons."""

    class_name: str
    recompiles: int = 0
    limit_hits: int = 0
    reasons: list[str] = field(default_factory=list)
    warned: bool = False
    limit_hits_reported: int = 0


def _entry_id(metrics: object) -> tuple[object, object]:
    """Compile ids restart after ``torch._dynamo.reset()``; start times do not."""
    return (getattr(metrics, "compile_id", None), getattr(metrics, "start_time_us", None))


class MetricsCursor:
    """torch's compilation records made since this cursor was created, each given once."""

    def __init__(self) -> None:
        self._seen = {_entry_id(m) for m in get_compilation_metrics()}

    def fresh(self) -> list[Any]:
        """The records made since the last call."""
        new = []
        for metrics in get_compilation_metrics():
            if _entry_id(metrics) not in self._seen:
                self._seen.add(_entry_id(metrics))
                new.append(metrics)
        return new


@dataclass(frozen=True)
class FrameCompile:
    """One frame dynamo compiled, or failed to, as torch recorded it: the code, the graph
    breaks it restarted its analysis on, and why it could not be compiled at all."""

    name: str
    filename: str
    line: int
    breaks: tuple[str, ...] = ()
    failure: str = ""

    @classmethod
    def of(cls, metrics: Any) -> FrameCompile:
        failure = metrics.fail_reason or ""
        if "recompile limit" in failure.lower():
            failure = ""  # counted as a recompile-limit hit, not a frame that breaks
        return cls(
            name=metrics.co_name,
            filename=metrics.co_filename or "",
            line=metrics.co_firstlineno or 0,
            breaks=tuple(sorted(metrics.restart_reasons or ())),
            failure=failure,
        )

    @property
    def where(self) -> str:
        return f"{self.name} at {self.filename}:{self.line}"


class FrameLog:
    """The frames torch compiled since the last look, for attribution to the region whose
    observed call was running."""

    def __init__(self) -> None:
        self.cursor = MetricsCursor()

    def new_frames(self) -> list[FrameCompile]:
        return [FrameCompile.of(m) for m in self.cursor.fresh() if m.co_name is not None]


def _key(code: CodeType) -> CodeKey:
    return (code.co_name, code.co_filename, code.co_firstlineno)


def region_codes(module: nn.Module) -> list[CodeType]:
    """The code objects dynamo compiles for a region of this module's class."""
    cls = type(unwrap(module))
    return [cls.forward.__code__, *(call.__code__ for call in existing_trampolines(cls))]


def plan_codes(plan: RegionPlan) -> set[CodeType]:
    """The code objects dynamo compiles for the regions of ``plan``."""
    return {code for region in plan.regions for code in region_codes(region.module)}


class RecompileWatch:
    """Running per-class tally of recompiles since this watch was created."""

    def __init__(self, plan: RegionPlan) -> None:
        self.plan = plan
        self.by_code: dict[CodeKey, ClassRecompiles] = {}
        self.by_frame: dict[str, ClassRecompiles] = {}
        self.cursor = MetricsCursor()

    @property
    def classes(self) -> list[ClassRecompiles]:
        return list({id(entry): entry for entry in self.by_code.values()}.values())

    def _index_codes(self) -> None:
        """Map region code to class, once: trampolines exist only after compilation."""
        if self.by_code:
            return
        by_class: dict[str, ClassRecompiles] = {e.class_name: e for e in self.by_code.values()}
        for region in self.plan.regions:
            entry = by_class.setdefault(region.class_name, ClassRecompiles(region.class_name))
            for code in region_codes(region.module):
                self.by_code.setdefault(_key(code), entry)

    def refresh(self) -> list[ClassRecompiles]:
        """Count the compiles torch recorded since the last refresh."""
        self._index_codes()
        for metrics in self.cursor.fresh():
            # "frame/attempt": an entry of a recompile-limit hit names no code, only its frame.
            frame = str(metrics.compile_id).split("/")[0]
            key = (metrics.co_name, metrics.co_filename, metrics.co_firstlineno)
            entry = self.by_code.get(key) or self.by_frame.get(frame)
            if entry is None:
                continue
            self.by_frame[frame] = entry
            if metrics.recompile_reason:
                entry.recompiles += 1
                entry.reasons.append(metrics.recompile_reason)
            if "recompile limit" in (metrics.fail_reason or "").lower():
                entry.limit_hits += 1
        return self.classes

    def new_limit_hits(self) -> list[ClassRecompiles]:
        """The classes that reached the recompile limit since the last call (each once)."""
        new = [entry for entry in self.refresh() if entry.limit_hits > entry.limit_hits_reported]
        for entry in new:
            entry.limit_hits_reported = entry.limit_hits
        return new

    def warn_storms(self, threshold: int) -> list[ClassRecompiles]:
        """Warn once per class that reached ``threshold`` recompiles; return those."""
        stormy = []
        for entry in self.refresh():
            if entry.recompiles >= threshold and not entry.warned:
                entry.warned = True
                stormy.append(entry)
                warnings.warn(
                    f"Region class {entry.class_name} recompiled {entry.recompiles} times "
                    f"(threshold {threshold}, recompile-limit hits {entry.limit_hits}). "
                    f"Torch's last reason: {entry.reasons[-1]}. Varying shapes are a common "
                    "cause: pad inputs to fixed sizes or pass dynamic=True.",
                    RecompileStormWarning,
                    stacklevel=2,
                )
        return stormy


@dataclass(frozen=True)
class Guard:
    """One guard failure from a dynamo recompile reason: what was checked, the source
    line that made the guard, and where that line is."""

    expression: str
    source: str = ""
    location: str = ""

    @property
    def on_input_tensor(self) -> bool:
        """A tensor input's metadata (requires_grad, size, stride, dtype), not an instance's."""
        return self.expression.startswith("tensor '")

    def __str__(self) -> str:
        where = f" at {self.location}" if self.location else ""
        line = f" ({self.source})" if self.source else ""
        return f"`{self.expression}`{where}{line}"


def parse_guard(reason: str) -> Guard:
    """The first guard failure of a ``recompile_reason``: ``"0/7: <guard>  # <source line>
    # <file>:<line> in <function> (HINT...)"``, as torch 2.11 to 2.15 write it. A float
    that torch < 2.13 specialised after its tensorify restart is written without the
    user's line (``compat.SPECIALISED_FLOAT_GUARD_WITHOUT_SOURCE``): ``___as_tensor(
    self.scale).item() == 0.1`` is read as ``self.scale == 0.1``, and torch's own
    ``(file:line in function)`` in place of the source line is dropped."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    first = re.sub(r"^\d+/\d+: ", "", first)
    parts = [part.strip() for part in first.split("  # ")]
    expression = re.sub(r"___as_tensor\(([\w.\[\]'\"]+)\)\.item\(\)", r"\1", parts[0])
    source = parts[1] if len(parts) > 1 and not parts[1].startswith("(") else ""
    location = re.sub(r"\s*\(HINT:.*$", "", parts[2]) if len(parts) > 2 else ""
    return Guard(expression, source, location)


#: How dynamo names a backend exception it turned into a graph break in its counters.
BACKEND_GRAPH_BREAK = "Backend compiler exception"


def graph_breaks() -> int:
    """Graph breaks dynamo counted in this process, including the backend exceptions it
    turned into graph breaks (counted under ``unimplemented``, not ``graph_break``)."""
    counters = dynamo_counters
    from_backend = sum(
        count
        for reason, count in counters["unimplemented"].items()
        if reason.startswith(BACKEND_GRAPH_BREAK)
    )
    return sum(counters["graph_break"].values()) + from_backend
