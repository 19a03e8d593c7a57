"""A compile that runs now, in words: what it compiles (a region's class, named by the
plan), which of the plan's distinct compiles it is, for how long so far, and in which of
torch's phases. Pure: ``strategies/status.py`` feeds it torch's compile events and draws
its text in the progress bar or the log."""

from __future__ import annotations

from dataclasses import dataclass
from types import CodeType

from .graph import unwrap
from .regions import RegionPlan
from .watch import region_codes

#: torch's compile events (``dynamo_timed``'s names) by the phase a user reads: the first
#: phase whose marks an event holds names it, looking from the innermost event out.
COMPILE_PHASES = (
    (("async_compile", "compile_file", "CodeCache"), "building kernels"),
    (
        ("inductor", "compile_fx", "fx_codegen", "GraphLowering", "Scheduler", "code_gen"),
        "inductor",
    ),
    (("aot_", "create_aot_dispatcher", "backward"), "AOTAutograd"),
    (("build_guards",), "guards"),
    (("bytecode_tracing",), "tracing"),
    (("backend_compile",), "backend"),
)


def compile_phase(events: list[str]) -> str:
    """The phase of a compile whose event stack (outermost first) is ``events``; "" where
    none of its events is known."""
    for event in reversed(events):
        for marks, phase in COMPILE_PHASES:
            if any(mark in event for mark in marks):
                return phase
    return ""


@dataclass(frozen=True)
class RunningCompile:
    """One compile, as it began: ``what`` it compiles, and which ``part`` of it ("" for
    the forward frame dynamo compiles, "backward" for a deferred backward: torch's
    ``compat.COMPILE_PARTS``), its ``index`` among the plan's ``total`` distinct compiles
    (None where the plan does not know it, or it compiles a second time), and when it
    ``began``."""

    what: str
    began: float
    index: int | None = None
    total: int | None = None
    part: str = ""
    again: bool = False

    @property
    def name(self) -> str:
        return f"{self.what}'s {self.part}" if self.part else self.what

    @property
    def count(self) -> str:
        """``"1 of 2"``, or "" where the plan does not know."""
        return "" if self.index is None else f"{self.index} of {self.total}"

    def headline(self) -> str:
        """``"compiling GPTBlock (1 of 2)"``: the start line's text."""
        count = f" ({self.count})" if self.count else ""
        return f"{'recompiling' if self.again else 'compiling'} {self.name}{count}"

    def text(self, now: float, phase: str = "") -> str:
        """``"compiling GPTBlock (1 of 2): 12 s, inductor"``."""
        seconds = f"{self.headline()}: {now - self.began:.0f} s"
        return f"{seconds}, {phase}" if phase else seconds

    def still(self, now: float) -> str:
        """``"still compiling GPTBlock: 60 s, 1 of 2"``: the heartbeat line's text."""
        count = f", {self.count}" if self.count else ""
        return f"still compiling {self.name}: {now - self.began:.0f} s{count}"


class CompileProgress:
    """The distinct compiles a plan knows (one per region class), and which of them began:
    a region class's first compile is ``k of n``, a later one a recompile."""

    def __init__(self, plan: RegionPlan) -> None:
        self.names: dict[CodeType, str] = {}
        for region in plan.regions:
            name = type(unwrap(region.module)).__name__
            for code in region_codes(region.module):
                self.names[code] = name
        self.total = len(set(self.names.values()))
        self.begun: list[str] = []  # what began compiling, first compiles in order
        self.by_id: dict[str, str] = {}  # a frame compile's id -> what it compiled

    def begin(
        self, code: CodeType | None, compile_id: str, part: str, now: float
    ) -> RunningCompile:
        """What a compile that begins now compiles: ``code`` (dynamo's frame), or a
        ``part`` of a graph compiled on its first call, known by its frame's
        ``compile_id``."""
        if part:
            what = self.by_id.get(compile_id, "a graph")
            index = self.begun.index(what) + 1 if what in self.begun else None
            return RunningCompile(what, now, index, self.total if index else None, part)
        known = self.names.get(code) if code is not None else None
        if known is None:  # not a region: the code's own name
            name = "a frame" if code is None else getattr(code, "co_qualname", code.co_name)
            self.by_id[compile_id] = name
            return RunningCompile(name, now)
        what = self.by_id[compile_id] = known
        if what in self.begun:
            return RunningCompile(what, now, again=True)
        self.begun.append(what)
        return RunningCompile(what, now, len(self.begun), self.total)
