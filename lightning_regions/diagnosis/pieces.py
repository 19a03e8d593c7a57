"""Regions whose calls ran in pieces, judged from torch's frame records: graph breaks
inside a region (part of its block runs eager between the pieces: torch's reasons, where,
the fix) and DDP's split of one graph at its gradient buckets (not a break: nothing runs
eager). Plain data in, plain data out; the fix texts are ``judge.FIXES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.graph import compress_paths
from ..core.watch import FrameCompile
from .judge import FIXES


@dataclass(frozen=True)
class RegionGraphBreaks:
    """A region class whose calls ran in pieces: torch's reasons, where, what runs eager."""

    class_name: str
    regions: tuple[str, ...]  # each affected instance's first path
    graphs_per_call: int
    reasons: tuple[str, ...]  # torch's, one line each, with where
    eager_frames: tuple[str, ...]  # frames torch could not compile at all
    fix: str

    where: tuple[str, ...] = ()  # the frames torch broke in

    def __str__(self) -> str:
        eager = (
            f" Not compiled at all, so eager: {'; '.join(self.eager_frames)}."
            if self.eager_frames
            else ""
        )
        where = f" Broken in: {'; '.join(self.where)}." if self.where else ""
        return (
            f"{self.class_name} ({compress_paths(self.regions)}): each call runs "
            f"{self.graphs_per_call} compiled graph(s), and what torch broke the graph on "
            f"runs eager between them. torch's reasons: {'; '.join(self.reasons)}.{where}"
            f"{eager} Fix: {self.fix}"
        )


@dataclass(frozen=True)
class RegionFrames:
    """What one region's observed calls showed of graph breaks: the most compiled graphs
    one call ran, the most pieces of them (DDP's split makes several of one), torch's
    frame compiles."""

    class_name: str
    path: str
    graphs_per_call: int
    frames: tuple[FrameCompile, ...]
    pieces_per_call: int = 0


@dataclass(frozen=True)
class DDPSplit:
    """A region class whose graph dynamo's DDP optimizer split at DDP's gradient-bucket
    boundaries: one graph compiled in pieces, so that the all-reduce of one bucket's
    gradients overlaps the backward of the next piece. Not a graph break: nothing runs
    eager between the pieces."""

    class_name: str
    regions: tuple[str, ...]
    pieces: int

    def __str__(self) -> str:
        return (
            f"{self.class_name} ({compress_paths(self.regions)}): each call runs one graph "
            f"in {self.pieces} pieces, split at DDP's gradient buckets for communication "
            "overlap (torch._dynamo.config.optimize_ddp); not graph breaks"
        )


def find_ddp_splits(regions: list[RegionFrames]) -> tuple[DDPSplit, ...]:
    """One entry per region class some of whose calls ran a graph in more pieces than
    graphs: DDP's split, not a graph break."""
    by_class: dict[str, list[RegionFrames]] = {}
    for region in regions:
        if region.pieces_per_call > max(region.graphs_per_call, 1):
            by_class.setdefault(region.class_name, []).append(region)
    return tuple(
        DDPSplit(name, tuple(r.path for r in split), max(r.pieces_per_call for r in split))
        for name, split in by_class.items()
    )


def find_graph_breaks(regions: list[RegionFrames]) -> tuple[RegionGraphBreaks, ...]:
    """One entry per region class whose observed calls ran more than one compiled graph
    or during which torch could not compile a frame."""
    by_class: dict[str, list[RegionFrames]] = {}
    for region in regions:
        if region.graphs_per_call > 1 or any(frame.failure for frame in region.frames):
            by_class.setdefault(region.class_name, []).append(region)
    found = []
    for class_name, split in by_class.items():
        frames = [frame for region in split for frame in region.frames]
        counted: dict[str, int] = {}
        for frame in frames:
            for text in frame.breaks:
                counted[summary(text)] = counted.get(summary(text), 0) + 1
        reasons = {f"{reason} ({count}x)": None for reason, count in counted.items()}
        where = dict.fromkeys(shorter(frame) for frame in frames if frame.breaks)
        failed = dict.fromkeys(
            f"{shorter(frame)}: {summary(frame.failure)}" for frame in frames if frame.failure
        )
        found.append(
            RegionGraphBreaks(
                class_name=class_name,
                regions=tuple(region.path for region in split),
                graphs_per_call=max(region.graphs_per_call for region in split),
                reasons=tuple(reasons) or ("not recorded by torch",),
                eager_frames=tuple(failed),
                fix=graph_break_fix(frames),
                where=tuple(where),
            )
        )
    return tuple(found)


def summary(reason: str) -> str:
    """torch's reason in one line: its kind and explanation, ``Dynamic shape operator:
    Operator `aten.nonzero.default`'s output shape depends on input Tensor data.``"""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    text = lines[0] + (
        f": {explanation.removeprefix('Explanation:').strip()}" if explanation else ""
    )
    return text[:200]


def hints(reason: str) -> list[str]:
    return [
        line.strip().removeprefix("Hint:").strip()
        for line in reason.splitlines()
        if line.strip().startswith("Hint:")
    ]


def shorter(frame: FrameCompile) -> str:
    """A frame as ``forward at <real file>:<line>``; a resume function says where it
    resumes (``forward, resumed at line 79``)."""
    resumed = re.fullmatch(r"torch_dynamo_resume_in_(\w+)_at_(\d+)", frame.name)
    name = f"{resumed.group(1)}, resumed at line {resumed.group(2)}" if resumed else frame.name
    return f"{name} in {frame.filename}:{frame.line}"


def graph_break_fix(frames: list[FrameCompile]) -> str:
    """What removes the breaks: for transformers' MoE experts and its log of an unset
    ``loss_type``, what was measured to work; else torch's own hints; else where to look."""
    text = " ".join(
        f"{frame.filename} {frame.name} {frame.breaks} {frame.failure}" for frame in frames
    )
    if "transformers" in text and re.search(r"moe|expert", text, re.IGNORECASE):
        return FIXES["moe_experts"]
    if "transformers" in text and "`loss_type=None` was set in the config" in text:
        return FIXES["transformers_loss_type"]
    found = dict.fromkeys(
        h for frame in frames for r in (*frame.breaks, frame.failure) for h in hints(r)
    )
    if found:
        return FIXES["graph_break_hint"].format(hints="; ".join(found))
    return FIXES["graph_break_unknown"]
