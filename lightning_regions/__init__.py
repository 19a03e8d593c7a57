"""Shared-aware regional ``torch.compile`` for PyTorch and PyTorch Lightning."""

from .compile import compile_regions
from .graph import ModuleGraph, snapshot
from .regions import NoRepeatedBlocksWarning, Region, RegionPlan, find_regions
from .report import RegionNotCompiledWarning, RegionReport, region_report, warn_if_not_compiled

__all__ = [
    "ModuleGraph",
    "NoRepeatedBlocksWarning",
    "Region",
    "RegionNotCompiledWarning",
    "RegionPlan",
    "RegionReport",
    "compile_regions",
    "find_regions",
    "region_report",
    "snapshot",
    "warn_if_not_compiled",
]
