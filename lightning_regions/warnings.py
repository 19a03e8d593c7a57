"""Every warning and error class the package raises, in one place to import from:
``from lightning_regions.warnings import RegionNotCompiledWarning``. The same names stay
importable from ``lightning_regions`` itself."""

from .background import BackgroundCompileWarning
from .cache import CacheArtifactsIgnoredWarning
from .fsdp import FSDPMeshWarning
from .nested import NestedRegionError
from .regions import NoRepeatedBlocksWarning
from .report import PerInstanceRecompileWarning, RegionGraphBreakWarning, RegionNotCompiledWarning
from .tiecheck import TiedWeightsError
from .tracking import RegionCompileError, RegionCompileWarning
from .watch import RecompileStormWarning

__all__ = [
    "BackgroundCompileWarning",
    "CacheArtifactsIgnoredWarning",
    "FSDPMeshWarning",
    "NestedRegionError",
    "NoRepeatedBlocksWarning",
    "PerInstanceRecompileWarning",
    "RecompileStormWarning",
    "RegionCompileError",
    "RegionCompileWarning",
    "RegionGraphBreakWarning",
    "RegionNotCompiledWarning",
    "TiedWeightsError",
]
