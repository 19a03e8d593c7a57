"""Lightning glue: the compile's figures in the Trainer's loggers (``trainer.loggers``:
CSV, TensorBoard, W&B...), on global rank zero, under one prefix, a few times a run:
never per step. Each figure is read from the object that holds it (the first step's
report, the gate's decision, the background compile), not kept a second time here;
the names are listed in docs/diagnosis.md."""

from __future__ import annotations

from typing import Any

from ..background.switch import BackgroundCompile
from ..core.calls import COMPILED, EAGER
from ..diagnosis.report import RegionReport
from ..gate.decision import PayoffDecision

#: Before every figure's name.
PREFIX = "regional_compile/"
#: The keep-or-revert decision as a number: a candidate is its place among them plus 2.
DECISION_NUMBERS = {EAGER: 0, COMPILED: 1}


def first_step_figures(report: RegionReport) -> dict[str, float]:
    """What the first step's report says: the backend's seconds, the graphs compiled,
    recompiles, graph breaks and the regions that ran without a compiled call."""
    return {
        "backend_seconds": report.compile_seconds,
        "graphs": report.graphs,
        "recompiles": sum(entry.recompiles for entry in report.recompiles),
        "graph_breaks": report.graph_breaks,
        "regions_eager": len(report.ran_eager),
    }


def decision_figures(decision: PayoffDecision) -> dict[str, float]:
    """The gate's two step medians and its decision (``DECISION_NUMBERS``)."""
    ways = [figure.way for figure in decision.candidates]
    number = DECISION_NUMBERS.get(decision.chosen)
    if number is None:
        number = 2 + ways.index(decision.chosen)
    return {
        "compiled_step_ms": decision.compiled_ms,
        "eager_step_ms": decision.eager_ms,
        "decision": number,
    }


def switch_figures(background: BackgroundCompile) -> dict[str, float]:
    """The background compile's switch: the step it came at, how long the first compiled
    step took after it (the stall), and whether the child failed (1) or not (0)."""
    outcome = background.outcome
    figures = {
        "background_switch_step": background.steps_eager + 1,
        "background_failed": float(bool(outcome is not None and outcome.failure)),
    }
    if background.stall_s is not None:
        figures["background_stall_s"] = background.stall_s
    return figures


def log_figures(trainer: Any, figures: dict[str, float]) -> None:
    """Log ``figures`` under ``PREFIX`` to each of ``trainer``'s loggers at its global step
    and save them (global rank zero; nothing where there is no Trainer or logger)."""
    if trainer is None or not trainer.loggers or not trainer.is_global_zero:
        return
    metrics = {PREFIX + name: float(value) for name, value in figures.items()}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
        logger.save()
