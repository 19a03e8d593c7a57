"""Lightning glue for the strategies that take the whole model into a wrapper of their
own at setup: FSDP1 (``FSDPStrategy``, ``FullyShardedDataParallel``) and DeepSpeed
(``DeepSpeedStrategy``, ``deepspeed.initialize``).

Neither calls ``model_to_device`` in ``setup``: FSDP1 moves the model as it wraps it,
and DeepSpeed's engine moves it. Both pass the model, in its precision, through
Lightning's wrap hook (``lightning_compat.LIGHTNING_WRAP_HOOK``) first, and that is where the
regions compile in place here: before the wrapper sees the model, as DDP's regions do in
``model_to_device``. Compiled in place, a block keeps its identity, parameters, hooks and
``state_dict`` keys, so FSDP1's auto-wrap policy finds it by its class.

DeepSpeed's engine hooks every module (ZeRO-3 gathers a module's parameters in a forward
pre-hook, frees them in a forward hook and does the same around its backward through
autograd functions applied there). ``module.compile()``, which accelerate's
``compile_regions_deepspeed`` and DeepSpeed's own ``engine.compile()`` use, compiles the
module's whole call, hooks included, and a block's forward calls its children's hooks:
dynamo then traces into ZeRO-3's hooks, breaks graphs on them, compiles DeepSpeed's own
frames and reaches its recompile limit there, and on a GPU the training diverged from
plain DeepSpeed (issue 51's measurement). So here each region's ``forward`` alone is
compiled (``compile_regions(eager_hooks=True)``), under every stage, and under ZeRO-3
each region is a ZeRO-3 leaf (``set_zero3_leaf``): ZeRO-3 hooks the region itself,
gathering all its parameters before its forward, and nothing inside it. Every DeepSpeed
hook then runs eager, outside the compiled code, as under plain DeepSpeed.

Both are GPU-only, in Lightning and in torch (FSDP1 refuses a CPU device itself:
"FSDP needs a non-CPU accelerator device"), so on a CPU they refuse as Lightning does.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy
from torch import nn
from typing_extensions import override

from ..compat import trace_zero3_linear_as_torch_linear
from ..core.regions import RegionPlan
from ..lightning_compat import lightning_wrap_model
from ..options import refuse_background_and_nested, split_options, takes_options
from .trainer import RegionalCompileMixin


class RegionalCompileWrappedMixin(RegionalCompileMixin):
    """Compiles the regions in place in Lightning's wrap hook, right before the engine
    wraps the model; ``model_to_device`` (which DeepSpeed calls to move a ZeRO-3 model
    while it loads a checkpoint) only moves it."""

    #: The engine's name in messages.
    engine = "this engine"

    def __init__(self, **kwargs: Any) -> None:
        refuse_background_and_nested(
            split_options(kwargs)[0],
            self.engine,
            background_why="the engine holds the parameters flattened or partitioned over "
            "the processes, which the child process cannot rebuild",
            nested_why="the engine wraps the model whole, so a nested unit would be compiled "
            "around the engine's own hooks (unmeasured)",
        )
        super().__init__(**kwargs)

    #: The wrap hook compiles, just before the engine's wrapper (``_setup_model``).
    compiles_in_model_to_device = False

    def _setup_model(self, model: nn.Module) -> Any:
        """Lightning's wrap hook: compile the regions in place (planned and prepared for
        the engine there: ``before_compile``), then let the engine wrap."""
        self.compile_in_place(self.set_up_module(), root_is_called=False)  # training_step
        return lightning_wrap_model(super(), model)


def make_zero3_leaves(plan: RegionPlan) -> None:
    """Make each region of ``plan`` a ZeRO-3 leaf, before ``deepspeed.initialize``: ZeRO-3
    then hooks the region itself and none of its descendants, so no ZeRO-3 hook is left
    inside a region's compiled forward."""
    for region in plan.regions:
        set_zero3_leaf(region.module)


@takes_options(base=FSDPStrategy.__init__)
class RegionalCompileFSDP1Strategy(RegionalCompileWrappedMixin, FSDPStrategy):
    """FSDP1 (Lightning's ``FSDPStrategy``) with each block compiled in place before
    ``FullyShardedDataParallel`` wraps it.

    Takes the regional options and every ``FSDPStrategy`` argument (``auto_wrap_policy``,
    ``sharding_strategy``, ``cpu_offload``, ``mixed_precision``, ``state_dict_type``...),
    all keyword-only. ``use_orig_params`` stays ``True`` (Lightning's default; compiled
    regions read their own parameters, which FSDP1 keeps only then); ``False`` raises.
    Needs a CUDA GPU, as ``FSDPStrategy`` does. Not with ``compile_in_background`` or
    ``granularity="nested"``.

    Args:
    """

    strategy_name = "regional_compile_fsdp1"
    description = "FSDP1, each block compiled in place before FullyShardedDataParallel wraps"
    engine = "FSDP1 (FSDPStrategy)"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.kwargs.get("use_orig_params"):
            raise ValueError(
                "use_orig_params=False: FSDP1 then replaces each block's parameters by one "
                "flat parameter, and a compiled region reads the block's own. Leave "
                "use_orig_params at Lightning's default (True)."
            )

    @property
    @override
    def accelerator(self) -> Any:
        return Strategy.accelerator.fget(self)  # type: ignore[attr-defined]

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        """The Trainer sets it at construction: refuse a CPU there with Lightning's own
        words (Lightning checks ``FSDPStrategy`` itself by exact type only)."""
        if accelerator is not None and not isinstance(accelerator, CUDAAccelerator):
            raise ValueError(
                f"The strategy `{self.strategy_name}` requires a GPU accelerator, but "
                f"received `accelerator={type(accelerator).__name__}()`. Please set "
                "`accelerator='cuda'`, `accelerator='gpu'`, or pass a `CUDAAccelerator()` "
                "instance to use FSDP."
            )
        Strategy.accelerator.fset(self, accelerator)  # type: ignore[attr-defined]


@takes_options(base=DeepSpeedStrategy.__init__)
class RegionalCompileDeepSpeedStrategy(RegionalCompileWrappedMixin, DeepSpeedStrategy):
    """DeepSpeed (Lightning's ``DeepSpeedStrategy``, ZeRO stages 1-3) with each block
    compiled in place before ``deepspeed.initialize`` takes the model.

    Takes the regional options and every ``DeepSpeedStrategy`` argument (``stage``,
    ``offload_optimizer``, ``offload_parameters``, ``config``...), all keyword-only.
    Registered as ``"regional_compile_deepspeed"`` and, as Lightning's names,
    ``"regional_compile_deepspeed_stage_1"`` ... ``"_stage_3_offload"``. Needs DeepSpeed
    and a CUDA GPU, as ``DeepSpeedStrategy`` does. Not with ``compile_in_background``
    or ``granularity="nested"``.

    Each region's ``forward`` alone is compiled, so DeepSpeed's hooks on it run eager, and
    under ZeRO-3 each region is a ZeRO-3 leaf: ZeRO-3 gathers a region's parameters all at
    once before its forward and hooks nothing inside it (the module docstring says why).

    Args:
    """

    strategy_name = "regional_compile_deepspeed"
    description = "DeepSpeed, each block compiled in place before deepspeed.initialize"
    engine = "DeepSpeed"
    eager_hooks = True
    #: Lightning's registered DeepSpeed variants (``deepspeed_stage_1``...), with ours'
    #: name suffix, description and arguments.
    variants: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("stage_1", "ZeRO stage 1", {"stage": 1}),
        ("stage_2", "ZeRO stage 2", {"stage": 2}),
        ("stage_2_offload", "ZeRO stage 2, CPU offload", {"stage": 2, "offload_optimizer": True}),
        ("stage_3", "ZeRO stage 3", {"stage": 3}),
        (
            "stage_3_offload",
            "ZeRO stage 3, CPU offload",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        ),
    )

    @override
    def before_compile(self, plan: RegionPlan) -> None:
        # under every stage: ZeRO-3's F.linear replacement outlives its engine, for the
        # whole process (compat.trace_zero3_linear_as_torch_linear)
        trace_zero3_linear_as_torch_linear()
        if self.zero_stage_3:
            make_zero3_leaves(plan)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)
        for suffix, what, arguments in cls.variants:
            strategy_registry.register(
                f"{cls.strategy_name}_{suffix}",
                cls,
                description=f"DeepSpeed {what}, blocks compiled in place",
                override=True,
                **arguments,
            )


def set_zero3_leaf(module: nn.Module) -> None:
    """Make ``module`` a ZeRO-3 leaf (``deepspeed.utils.set_z3_leaf_module``): ZeRO-3 then
    hooks it alone, gathering all its parameters before its forward, and none of its
    descendants. Before ``deepspeed.initialize``."""
    from deepspeed.utils import set_z3_leaf_module

    set_z3_leaf_module(module, True)
