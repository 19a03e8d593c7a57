"""Shared-aware regional ``torch.compile`` for PyTorch and PyTorch Lightning.

Importing the package registers the ``"regional_compile"`` and
``"regional_compile_ddp"`` strategy names with Lightning's ``StrategyRegistry``.
"""

from .cache import CacheArtifactsIgnoredWarning
from .compile import compile_regions, end_observation
from .graph import ModuleGraph, snapshot
from .regions import NoRepeatedBlocksWarning, Region, RegionPlan, find_regions
from .report import RegionNotCompiledWarning, RegionReport, region_report, warn_if_not_compiled
from .strategy import RegionalCompileDDPStrategy, RegionalCompileStrategy, register
from .tiecheck import TieCheck, TiedWeightsCheck, TiedWeightsError
from .tracking import RegionCompileError, RegionCompileWarning
from .watch import RecompileStormWarning

register()

__all__ = [
    "CacheArtifactsIgnoredWarning",
    "ModuleGraph",
    "NoRepeatedBlocksWarning",
    "RecompileStormWarning",
    "Region",
    "RegionCompileError",
    "RegionCompileWarning",
    "RegionNotCompiledWarning",
    "RegionPlan",
    "RegionReport",
    "RegionalCompileDDPStrategy",
    "RegionalCompileStrategy",
    "TieCheck",
    "TiedWeightsCheck",
    "TiedWeightsError",
    "compile_regions",
    "end_observation",
    "find_regions",
    "region_report",
    "snapshot",
    "warn_if_not_compiled",
]
