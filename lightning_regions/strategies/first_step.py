"""The first-step reporter: what a strategy says once regions have run a training step,
and what it watches for afterwards.

After the first optimizer step it logs a one-line summary, warns about what lost
something (regions left eager, recompiles per instance, graph breaks) and ends the
observation of region calls. From then on it reads torch's compile records at loop
ends and optimizer steps (never per region call): a class that reached dynamo's
recompile limit is warned about once, naming the phase, torch's guard and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..compat import recompile_limit
from ..core.compile import end_observation, tracker_of
from ..core.graph import compress_paths
from ..diagnosis.judge import judge_limit_fallback
from ..diagnosis.report import (
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
    RegionNotCompiledWarning,
    RegionReport,
    region_report,
    warn_about,
)

#: What the strategies warn about once, after the first optimizer step.
WARNED_AT_FIRST_STEP = (
    RegionNotCompiledWarning,
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
)


class FirstStepReporter:
    """Reports a module's regions once after the first optimizer step of each setup,
    then watches for recompile-limit fallbacks and storms."""

    def __init__(self, recompile_warn_threshold: int | Literal["auto"] | None) -> None:
        self._threshold = recompile_warn_threshold
        self._reported: set[int] = set()  # modules whose first step this setup reported
        self.trained = False  # some optimizer step ran, in this or an earlier setup
        #: Regions warned about as falling back to eager after the first step, this setup.
        self.fallbacks = 0

    @property
    def threshold(self) -> int | None:
        """Recompiles of one class that give a ``RecompileStormWarning``: ``"auto"`` is one
        less than dynamo's ``recompile_limit`` (read when used), so the warning comes
        while the class still runs compiled, before the next recompile would fall back."""
        if self._threshold == "auto":
            return max(1, recompile_limit() - 1)
        return self._threshold

    def enter(self) -> None:
        """A new setup: its first optimizer step is reported again."""
        self._reported.clear()
        self.fallbacks = 0

    def has_reported(self, module: Any) -> bool:
        """Whether ``module``'s first optimizer step in this setup was reported."""
        return id(module) in self._reported

    def runs_eager(self, module: Any) -> None:
        """``module``'s regions run eager in this setup (as an earlier decision chose):
        its first step has nothing compiled to report."""
        self._reported.add(id(module))

    def after_optimizer_step(self, module: Any, phase: str = "training") -> RegionReport | None:
        """Watch recompiles; after the first step, report once and end observation: the
        report, that once."""
        tracker = tracker_of(module)
        if tracker is None:
            return None
        if self.has_reported(module):
            self.watch_recompiles(module, phase)
            return None
        if self.threshold is not None:
            tracker.watch.warn_storms(self.threshold)
        self._reported.add(id(module))
        self.trained = True
        report = region_report(module)
        end_observation(module)
        tracker.watch.new_limit_hits()  # the first step's are in the warnings below
        rank_zero_info(runtime_summary(report))
        with warnings.catch_warnings():
            for category in WARNED_AT_FIRST_STEP:
                warnings.simplefilter("always", category)
            warn_about(report)
        return report

    def watch_recompiles(self, module: Any, phase: str) -> int:
        """Warn once per region class that reached dynamo's recompile limit since the last
        look (``RegionNotCompiledWarning``, naming ``phase``, torch's guard and the fix),
        and of recompile storms: how many fell back now (``fallbacks`` adds them up)."""
        tracker = tracker_of(module)
        if tracker is None:
            return 0
        hits = tracker.watch.new_limit_hits()
        self.fallbacks += len(hits)
        for entry in hits:
            entry.warned = True  # this says more than a storm warning would
            fallback = judge_limit_fallback(entry, phase, recompile_limit(), trained=self.trained)
            with warnings.catch_warnings():
                warnings.simplefilter("always", RegionNotCompiledWarning)
                warnings.warn(str(fallback), RegionNotCompiledWarning, stacklevel=3)
        if self.threshold is not None:
            tracker.watch.warn_storms(self.threshold)
        return len(hits)


def runtime_summary(report: RegionReport) -> str:
    """From torch's own records, taken after the first optimizer step: one line, then a
    line per class whose extra graphs are bounded (variants, a per-instance number) and
    one for regions never called; what loses something is warned about instead."""
    recompiles = sum(entry.recompiles for entry in report.recompiles)
    graphs = f"{report.graphs} graph(s) compiled"
    if report.graphs == 0 and any(row.compiled_calls for row in report.rows):
        graphs += " (the regions ran code compiled earlier in this process)"
    lines = [
        f"regional compile after first step: {graphs}, "
        f"{recompiles} recompile(s), {report.graph_breaks} graph break(s), "
        f"{report.compile_seconds:.2f}s in the backend, "
        f"{len(report.ran_eager)} region(s) called without a compiled call"
    ]
    lines += [f"  graphs of {entry}" for entry in report.per_instance if entry.bounded]
    lines += [f"  compiled in pieces: {split}" for split in report.ddp_split]
    if report.never_called:
        names = compress_paths(row.paths[0] for row in report.never_called)
        lines.append(
            f"  {len(report.never_called)} region(s) not called in the first step (nothing "
            f"ran eager there): {names}"
        )
    return "\n".join(lines)
