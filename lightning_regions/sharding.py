"""Sharding by the region plan with FSDP2, so the compile unit and the shard unit agree.

``shard_by_plan`` applies ``fully_shard`` to each distinct region once (a block
registered at several positions is one group), then to the top-level children of the
root that still hold unsharded parameters. Children that share a parameter (tied input
and output embeddings held by two children) are sharded as one group, so the tie
stays one ``Parameter``. The root itself is never sharded: under Lightning nobody calls
the LightningModule's ``forward``, so a root group would never be gathered.

Plain torch: no Lightning import here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .regions import RegionPlan

log = logging.getLogger(__name__)

#: Lightning ``precision=`` values the automatic sharding supports, and the FSDP2
#: mixed-precision policy each one gets (``None``: parameters stay as they are).
MIXED_PRECISION_POLICIES: dict[str, MixedPrecisionPolicy | None] = {
    "32-true": None,
    "bf16-true": None,
    "16-true": None,
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for a Lightning ``precision=`` value; raises for the others."""
    if precision not in MIXED_PRECISION_POLICIES:
        raise ValueError(
            f"precision={precision!r} is not supported when the strategy shards the model "
            f"itself: use one of {sorted(MIXED_PRECISION_POLICIES)}, or shard in "
            "configure_model() with your own MixedPrecisionPolicy."
        )
    return MIXED_PRECISION_POLICIES[precision]


def shard_by_plan(
    root: nn.Module,
    plan: RegionPlan,
    mesh: Any,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[str]:
    """``fully_shard`` each region once, then the root's children; return the groups.

    Each returned entry names one FSDP group by its module paths. Raises ``ValueError``
    when a parameter would stay unsharded (held by the root itself), since its
    gradients would not be reduced across ranks.
    """
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    groups: list[str] = []
    for region in plan.regions:
        if not isinstance(region.module, FSDPModule):  # a second setup() shards nothing
            fully_shard(region.module, **options)
            groups.append(region.label)
    for names in _unsharded_child_groups(root):
        children = [root.get_submodule(name) for name in names]
        fully_shard(children if len(children) > 1 else children[0], **options)
        groups.append(" + ".join(names))
    left = [name for name, p in root.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise ValueError(
            f"Parameters {left} are held by {type(root).__name__} itself, so sharding by "
            "the region plan would leave them unsharded and their gradients unreduced. "
            "Move them into a submodule, or shard in configure_model()."
        )
    log.info("fully_shard applied to %d group(s): %s", len(groups), "; ".join(groups))
    return groups


def _unsharded_child_groups(root: nn.Module) -> list[list[str]]:
    """Names of the root's children with unsharded parameters, children sharing one
    parameter in one group, in registration order."""
    groups: list[list[str]] = []
    owner_of_param: dict[int, list[str]] = {}
    seen: set[int] = set()
    for name, child in root.named_children():
        if id(child) in seen:
            continue  # an alias of an earlier child
        seen.add(id(child))
        params = [p for p in child.parameters() if not isinstance(p, DTensor)]
        if not params:
            continue
        joined = next((owner_of_param[id(p)] for p in params if id(p) in owner_of_param), None)
        group = joined if joined is not None else []
        if joined is None:
            groups.append(group)
        group.append(name)
        for p in params:
            owner_of_param[id(p)] = group
    return groups
