"""Any strategy class with the regions: ``regional_strategy(MyStrategy)``.

Frameworks and clusters bring strategy classes of their own (Ray Train's
``RayDDPStrategy``, whose ``prepare_trainer`` accepts only its own classes and their
subclasses; a cluster's DDP with a custom environment), and users write their own. Rather
than one of ours for each, ``regional_strategy`` makes a subclass of theirs with our
hooks mixed in before it, so their ``isinstance`` checks still hold and every argument
of theirs still works. The mixin is the one our strategy of the same engine uses, so a
Ray DDP strategy compiles exactly as ``RegionalCompileDDPStrategy`` does:

==========================================  ==========================================
``base`` is a subclass of                   mixed in before it
==========================================  ==========================================
Lightning's ``ModelParallelStrategy``       ``RegionalCompileFSDPStrategy`` (FSDP2)
Lightning's ``FSDPStrategy``                ``RegionalCompileFSDP1Strategy``
Lightning's ``DeepSpeedStrategy``           ``RegionalCompileDeepSpeedStrategy``
Lightning's ``DDPStrategy``                 ``RegionalCompileDDPStrategy``
any other Lightning ``Strategy``            ``RegionalCompileMixin``
Fabric's ``DDPStrategy``                    Fabric's ``RegionalCompileDDPStrategy``
Fabric's ``SingleDeviceStrategy``           Fabric's ``RegionalCompileStrategy``
any other Fabric ``Strategy``               ``RegionalCompileFabricMixin``
==========================================  ==========================================

A class factory rather than the mixins alone: the right mixin for an engine is ours to
know (a DDP subclass needs regions kept whole under DDP; FSDP1 and DeepSpeed compile in
another hook), the options' signature for LightningCLI is made once, and one base gives
one class, however often it is asked for.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)

from ..options import takes_options
from . import fabric
from .fsdp import RegionalCompileFSDPStrategy
from .trainer import (
    RegionalCompileBase,
    RegionalCompileDDPStrategy,
    RegionalCompileMixin,
    RegionalCompileStrategy,
)
from .wrapping import RegionalCompileDeepSpeedStrategy, RegionalCompileFSDP1Strategy

StrategyType = TypeVar("StrategyType", bound=type)

#: Lightning's strategy classes and what is mixed in before a subclass of each, the most
#: specific first (``DeepSpeedStrategy`` is a ``DDPStrategy``). A subclass of
#: ``SingleDeviceStrategy`` gets the plain mixin: ``RegionalCompileStrategy`` takes its
#: device from the Trainer, which a subclass's own ``__init__`` may not allow.
TRAINER_ENGINES: tuple[tuple[type, type[RegionalCompileBase]], ...] = (
    (ModelParallelStrategy, RegionalCompileFSDPStrategy),
    (FSDPStrategy, RegionalCompileFSDP1Strategy),
    (DeepSpeedStrategy, RegionalCompileDeepSpeedStrategy),
    (DDPStrategy, RegionalCompileDDPStrategy),
    (Strategy, RegionalCompileMixin),
)
FABRIC_ENGINES: tuple[tuple[type, type[RegionalCompileBase]], ...] = (
    (FabricDDPStrategy, fabric.RegionalCompileDDPStrategy),
    (FabricSingleDeviceStrategy, fabric.RegionalCompileStrategy),
    (FabricStrategy, fabric.RegionalCompileFabricMixin),
)
#: Lightning's classes that are an engine of ours as they are.
OURS: dict[type, type[RegionalCompileBase]] = {
    **{lightning: ours for lightning, ours in TRAINER_ENGINES + FABRIC_ENGINES},
    SingleDeviceStrategy: RegionalCompileStrategy,
}


def regional_strategy(base: StrategyType) -> StrategyType:
    """``base``, a Lightning or Fabric strategy class, with the LightningModule's (or
    Fabric module's) regions compiled in place as our strategies compile them.

    Returns a subclass of ``base`` named ``Regional<base name>`` that takes the regional
    options beside ``base``'s own arguments, all keyword-only; the same class for the
    same ``base`` every time. Where ``base`` is a Lightning or Fabric class we have a
    strategy for (``DDPStrategy``...), that strategy itself. Ray Train::

        from ray.train.lightning import RayDDPStrategy
        strategy = regional_strategy(RayDDPStrategy)(compile_in_background=True)
        trainer = ray.train.lightning.prepare_trainer(pl.Trainer(strategy=strategy, ...))

    Raises ``TypeError`` for a class that is not a strategy, and for Fabric's
    ``DeepSpeedStrategy`` (it sets up model and optimizer together, past the hook our
    Fabric strategies compile in).
    """
    if not isinstance(base, type) or not issubclass(base, (Strategy, FabricStrategy)):
        raise TypeError(
            f"regional_strategy({base!r}): pass a strategy class, a subclass of "
            "lightning.pytorch.strategies.Strategy or lightning.fabric.strategies.Strategy "
            "(the class, not an instance)."
        )
    if issubclass(base, FabricDeepSpeedStrategy):
        raise TypeError(
            f"regional_strategy({base.__name__}): Fabric's DeepSpeedStrategy sets up the "
            "module and its optimizers together, past setup_module, where Fabric's regional "
            "strategies compile. Use the Trainer's RegionalCompileDeepSpeedStrategy, or "
            "compile_regions(module, inplace=True) before fabric.setup()."
        )
    if issubclass(base, RegionalCompileBase):
        return base
    return _compose(base)  # type: ignore[return-value]


@functools.cache
def _compose(base: type) -> type:
    if base in OURS:
        return OURS[base]  # a Lightning class we have a strategy for: that strategy
    engines = TRAINER_ENGINES if issubclass(base, Strategy) else FABRIC_ENGINES
    ours = next(ours for lightning, ours in engines if issubclass(base, lightning))
    namespace: dict[str, Any] = {
        "__doc__": f"{base.__name__} with the regions compiled in place (made by "
        f"lightning_regions.regional_strategy, mixing in {ours.__name__}).\n\n    Args:\n",
        "__module__": __name__,
        "__qualname__": f"Regional{base.__name__}",
    }
    composed = type(f"Regional{base.__name__}", (ours, base), namespace)
    return takes_options(ours.excluded_options, base=base.__init__)(composed)  # type: ignore[misc]
