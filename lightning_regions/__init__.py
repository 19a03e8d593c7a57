"""Shared-aware regional ``torch.compile`` for PyTorch and PyTorch Lightning.

The warning and error classes are also in ``lightning_regions.warnings``.

Importing the package registers the ``"regional_compile"``, ``"regional_compile_ddp"``,
``"regional_compile_fsdp"`` (FSDP2), ``"regional_compile_fsdp1"`` and
``"regional_compile_deepspeed"`` (and its ``_stage_N`` variants) strategy names with
Lightning's ``StrategyRegistry``. ``regional_strategy(MyStrategy)`` gives any other
strategy class the regions (Ray Train's, a cluster's, your own).
"""

from . import compat  # noqa: F401  # checks torch's private names before anything uses them
from .background.switch import BackgroundCompileWarning
from .cache import CacheArtifactsIgnoredWarning
from .core.compile import compile_regions, end_observation
from .core.graph import ModuleGraph, snapshot
from .core.nested import NestedRegionError
from .core.regions import NoRepeatedBlocksWarning, Region, RegionPlan, find_regions
from .core.tracking import RegionCompileError, RegionCompileWarning
from .core.watch import RecompileStormWarning
from .diagnosis.report import (
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
    RegionNotCompiledWarning,
    RegionReport,
    region_report,
    warn_about,
    warn_graph_breaks,
    warn_if_not_compiled,
    warn_per_instance_recompiles,
)
from .diagnosis.tiecheck import TieCheck, TiedWeightsCheck, TiedWeightsError
from .strategies.compose import regional_strategy
from .strategies.fsdp import FSDPMeshWarning, RegionalCompileFSDPStrategy
from .strategies.trainer import (
    RegionalCompileDDPStrategy,
    RegionalCompileMixin,
    RegionalCompileStrategy,
    register,
)
from .strategies.wrapping import RegionalCompileDeepSpeedStrategy, RegionalCompileFSDP1Strategy

register(
    RegionalCompileFSDPStrategy, RegionalCompileFSDP1Strategy, RegionalCompileDeepSpeedStrategy
)

__all__ = [
    "BackgroundCompileWarning",
    "CacheArtifactsIgnoredWarning",
    "FSDPMeshWarning",
    "ModuleGraph",
    "NestedRegionError",
    "NoRepeatedBlocksWarning",
    "PerInstanceRecompileWarning",
    "RecompileStormWarning",
    "Region",
    "RegionCompileError",
    "RegionCompileWarning",
    "RegionGraphBreakWarning",
    "RegionNotCompiledWarning",
    "RegionPlan",
    "RegionReport",
    "RegionalCompileDDPStrategy",
    "RegionalCompileDeepSpeedStrategy",
    "RegionalCompileFSDP1Strategy",
    "RegionalCompileFSDPStrategy",
    "RegionalCompileMixin",
    "RegionalCompileStrategy",
    "TieCheck",
    "TiedWeightsCheck",
    "TiedWeightsError",
    "compile_regions",
    "end_observation",
    "find_regions",
    "region_report",
    "regional_strategy",
    "snapshot",
    "warn_about",
    "warn_graph_breaks",
    "warn_if_not_compiled",
    "warn_per_instance_recompiles",
]
