"""Shared-aware regional ``torch.compile`` for PyTorch and PyTorch Lightning.

Importing the package registers the ``"regional_compile"``, ``"regional_compile_ddp"``
and ``"regional_compile_fsdp"`` strategy names with Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .compat import require_torch_apis

require_torch_apis()  # before anything touches torch's private names

from .cache import CacheArtifactsIgnoredWarning  # noqa: E402
from .compile import compile_regions, end_observation  # noqa: E402
from .fsdp import FSDPMeshWarning, RegionalCompileFSDPStrategy  # noqa: E402
from .graph import ModuleGraph, snapshot  # noqa: E402
from .nested import NestedRegionError  # noqa: E402
from .regions import NoRepeatedBlocksWarning, Region, RegionPlan, find_regions  # noqa: E402
from .report import (  # noqa: E402
    PerInstanceRecompileWarning,
    RegionNotCompiledWarning,
    RegionReport,
    region_report,
    warn_if_not_compiled,
    warn_per_instance_recompiles,
)
from .strategy import RegionalCompileDDPStrategy, RegionalCompileStrategy, register  # noqa: E402
from .tiecheck import TieCheck, TiedWeightsCheck, TiedWeightsError  # noqa: E402
from .tracking import RegionCompileError, RegionCompileWarning  # noqa: E402
from .watch import RecompileStormWarning  # noqa: E402

register()
RegionalCompileFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
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
    "RegionNotCompiledWarning",
    "RegionPlan",
    "RegionReport",
    "RegionalCompileDDPStrategy",
    "RegionalCompileFSDPStrategy",
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
    "warn_per_instance_recompiles",
]
