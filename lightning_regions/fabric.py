"""The regional strategies for Lightning Fabric, by their public path:
``Fabric(strategy=lightning_regions.fabric.RegionalCompileStrategy())`` or
``Fabric(strategy="regional_compile")``. They are defined in
``lightning_regions.strategies.fabric``; importing the package registers their names in
Fabric's strategy registry."""

from .strategies.fabric import (
    RegionalCompileDDPStrategy,
    RegionalCompileFabricMixin,
    RegionalCompileStrategy,
    register,
)

__all__ = [
    "RegionalCompileDDPStrategy",
    "RegionalCompileFabricMixin",
    "RegionalCompileStrategy",
    "register",
]
