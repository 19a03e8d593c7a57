"""Every warning and error class the package raises, in one place to import from:
``from lightning_regions.warnings import RegionNotCompiledWarning``. The same names stay
importable from ``lightning_regions`` itself."""

from .background.switch import BackgroundCompileWarning
from .cache import CacheArtifactsIgnoredWarning
from .core.nested import NestedRegionError
from .core.regions import NoRepeatedBlocksWarning
from .core.tracking import RegionCompileError, RegionCompileWarning
from .core.watch import RecompileStormWarning
from .diagnosis.report import (
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
    RegionNotCompiledWarning,
)
from .diagnosis.tiecheck import TiedWeightsError
from .strategies.fsdp import FSDPMeshWarning

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
