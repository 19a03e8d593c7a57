"""Lightning glue for FSDP2: ``RegionalCompileFSDPStrategy`` on ``ModelParallelStrategy``.

Two ways to run, chosen by the LightningModule:

- **The user shards.** ``configure_model()`` is overridden: Lightning runs it as
  always (``fully_shard``, tensor parallelism, activation checkpointing...), and the
  regions are compiled in place in ``model_to_device``, as under the other strategies.
- **The strategy shards.** No ``configure_model()``: in ``model_to_device`` the strategy
  shards by the region plan (``sharding.shard_by_plan``: each region once, then the
  top-level children), then compiles the regions. The mesh is one data-parallel
  dimension over every process.

``ModelParallelStrategy.setup`` raises ``TypeError`` for a module without
``configure_model()`` before any hook runs. In the second case the strategy stands in
for that hook while ``setup`` runs (an instance attribute, removed afterwards), rather
than copying ``setup``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..core.regions import RegionPlan
from ..core.sharding import fsdp_data_parallel_size, mixed_precision_policy, shard_by_plan
from ..lightning_compat import model_parallel_sizes, set_model_parallel_sizes
from ..options import RegionalOptions, refuse_background_and_nested, takes_options
from .trainer import RegionalCompileMixin


class FSDPMeshWarning(UserWarning):
    """The model's FSDP2 mesh covers more processes than the data-parallel size."""


@takes_options()
class RegionalCompileFSDPStrategy(RegionalCompileMixin, ModelParallelStrategy):
    """FSDP2 (Lightning's ``ModelParallelStrategy``) with the regions compiled in place.

    When the strategy shards, ``precision=`` sets FSDP2's ``MixedPrecisionPolicy``:
    ``"bf16-mixed"`` gathers parameters in bfloat16 and reduces gradients in float32;
    ``"32-true"``, ``"bf16-true"`` and ``"16-true"`` keep the parameters' own dtype.
    ``granularity="nested"`` raises (see docs/granularity.md). Every argument is
    keyword-only.

    Args:
        reshard_after_forward: when the strategy shards, free each group's gathered
            parameters after its forward (``fully_shard``'s own argument; ``False``
            keeps them until backward: more memory, one all-gather less).
        data_parallel_size: as for ``ModelParallelStrategy``. When the strategy shards,
            ``"auto"`` is every process.
        tensor_parallel_size: as for ``ModelParallelStrategy``. When the strategy
            shards it applies no tensor parallelism, so ``"auto"`` is 1 and more raises.
        save_distributed_checkpoint: as for ``ModelParallelStrategy``.
        process_group_backend: as for ``ModelParallelStrategy`` (``"gloo"`` on CPU).
        timeout: as for ``ModelParallelStrategy``.
    """

    strategy_name = "regional_compile_fsdp"
    description = "FSDP2, sharded by the region plan, regions compiled in place"
    #: Shard first, then compile (see docs/fsdp.md): measured on the first step.
    compile_before_shard = False

    def __init__(
        self,
        *,
        reshard_after_forward: bool = True,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **options: Any,
    ) -> None:
        refuse_background_and_nested(
            RegionalOptions(**options),
            "FSDP2",
            background_why="a sharded region's parameters are DTensors spread over the "
            "processes, which the child process cannot rebuild",
            nested_why="dynamo does not trace the model whole through fully_shard's hooks "
            "(measured on torch 2.13: the blocks compile as frames of their own and none runs "
            "as a nested region), so it would be granularity='regions' with a wrong report",
        )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **options,
        )
        self.reshard_after_forward = reshard_after_forward
        #: Set in ``setup_environment``: True when the LightningModule has no
        #: ``configure_model()`` and the strategy shards by the region plan.
        self.shards_by_plan = False
        #: The FSDP groups the strategy made, each named by its module paths.
        self.sharded_groups: list[str] = []
        self._mesh_checked = False

    def setup_environment(self) -> None:
        self.shards_by_plan = not is_overridden("configure_model", self.lightning_module)
        if self.shards_by_plan:
            set_model_parallel_sizes(self, *self._plan_mesh_sizes())
        super().setup_environment()

    def _plan_mesh_sizes(self) -> tuple[int, int]:
        """One data-parallel dimension over every process: we apply no tensor parallelism."""
        data_size, tensor = model_parallel_sizes(self)
        if tensor not in ("auto", 1):
            raise ValueError(
                f"tensor_parallel_size={tensor}: when the strategy shards (the "
                f"{type(self.lightning_module).__name__} has no configure_model()), it "
                "applies FSDP2 only. Use tensor_parallel_size=1, or apply tensor "
                "parallelism yourself in configure_model()."
            )
        world = self.num_nodes * self.num_processes
        data = world if data_size == "auto" else data_size
        return data, 1

    def setup(self, trainer: Any) -> None:
        if not self.shards_by_plan:
            super().setup(trainer)
            return
        with _configure_model_supplied(self.lightning_module):
            super().setup(trainer)

    def model_to_device(self) -> None:
        if not self.shards_by_plan:
            self._warn_if_batches_repeat()  # the user sharded; compile after device placement
        super().model_to_device()

    @override
    def before_compile(self, plan: RegionPlan) -> None:
        """Shard by the plan the regions compile by (one plan for both)."""
        if self.shards_by_plan and not self.compile_before_shard:
            self._shard(plan)

    @override
    def after_compile(self, plan: RegionPlan) -> None:
        if self.shards_by_plan and self.compile_before_shard:
            self._shard(plan)

    def _warn_if_batches_repeat(self) -> None:
        """Warn once when the user's FSDP2 groups shard over more processes than the
        data-parallel size: processes that share a data-parallel rank get the same
        batches, so part of every step is computed twice."""
        if self._mesh_checked:
            return
        self._mesh_checked = True
        sharded_over = fsdp_data_parallel_size(self.set_up_module())
        data_parallel = self.device_mesh["data_parallel"].size()
        asked_data, asked_tensor = model_parallel_sizes(self)
        if sharded_over is not None and sharded_over > data_parallel:
            rank_zero_warn(
                f"The model's FSDP2 groups shard over {sharded_over} processes, but the "
                f"data-parallel size is {data_parallel} (data_parallel_size={asked_data}, "
                f"tensor_parallel_size={asked_tensor}), so processes with one data-parallel "
                "rank are fed the same batches. Pass "
                f"data_parallel_size={sharded_over}, tensor_parallel_size=1 to the strategy, "
                "or shard with fully_shard(..., mesh=self.device_mesh['data_parallel']).",
                category=FSDPMeshWarning,
            )

    def _shard(self, plan: RegionPlan) -> None:
        policy = mixed_precision_policy(self.precision_plugin.precision)
        self.sharded_groups += shard_by_plan(
            self.set_up_module(),
            plan,
            self.device_mesh["data_parallel"],
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=policy,
        )
        rank_zero_info(
            f"FSDP2: {len(self.sharded_groups)} group(s) sharded by the region plan: "
            + "; ".join(self.sharded_groups)
        )


@contextmanager
def _configure_model_supplied(module: Any) -> Iterator[None]:
    """While ``ModelParallelStrategy.setup`` checks for ``configure_model()``, the module
    shows one that does nothing: the strategy's sharding takes its place."""
    module.configure_model = _sharded_by_strategy
    try:
        yield
    finally:
        del module.configure_model


def _sharded_by_strategy() -> None:
    """RegionalCompileFSDPStrategy shards this module by its region plan."""
