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
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..compat import fsdp_param_groups, registered_children, registered_parameters
from .regions import Region, RegionPlan

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

    Each returned entry names one FSDP group by its module paths. Raises ``ValueError``,
    before sharding anything, when a parameter would stay unsharded (held by the root
    itself: its gradients would not be reduced across ranks) or fall into two groups.
    """
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    own = [name for name, p in registered_parameters(root).items() if p is not None]
    if own:
        raise ValueError(
            f"Parameters {own} are held by {type(root).__name__} itself, so sharding by "
            "the region plan would leave them unsharded and their gradients unreduced. "
            "Move them into a submodule, or shard in configure_model()."
        )
    children = _unsharded_children(root, plan.region_ids())
    _check_each_parameter_in_one_group(plan, children)
    groups: list[str] = []
    for region in plan.regions:
        if not isinstance(region.module, FSDPModule):  # a second setup() shards nothing
            fully_shard(region.module, **options)
            groups.append(region.label)
    for names in _child_groups(children):
        group = [root.get_submodule(name) for name in names]
        fully_shard(group if len(group) > 1 else group[0], **options)
        groups.append(" + ".join(names))
    log.info("fully_shard applied to %d group(s): %s", len(groups), "; ".join(groups))
    return groups


def _unsharded_children(
    root: nn.Module, region_ids: set[int]
) -> list[tuple[str, list[nn.Parameter]]]:
    """Each distinct child of the root not yet sharded, with its parameters outside every
    region (their own groups hold those), in registration order; children without any
    are left out."""
    children: list[tuple[str, list[nn.Parameter]]] = []
    seen: set[int] = set()
    for name, child in root.named_children():
        if id(child) in seen or isinstance(child, FSDPModule):
            continue  # an alias of an earlier child, or sharded by an earlier setup()
        seen.add(id(child))
        params = list({id(p): p for p in _params_outside(child, region_ids)}.values())
        if params:
            children.append((name, params))
    return children


def _check_each_parameter_in_one_group(
    plan: RegionPlan, children: list[tuple[str, list[nn.Parameter]]]
) -> None:
    """Raise before sharding if a parameter would fall into two FSDP groups: FSDP2 would
    give one group a new sharded ``Parameter`` and leave the other the old one, a tie
    silently broken."""
    owner: dict[int, tuple[Region, str]] = {}
    for region in plan.regions:
        for name, p in region.module.named_parameters():
            first_region, first_name = owner.setdefault(id(p), (region, name))
            if first_region is not region:
                first = f"{first_region.label} ({first_name})"
                raise ValueError(_two_groups(first, f"{region.label} ({name})"))
    for name, params in children:
        for p in params:
            if id(p) in owner:
                first_region, first_name = owner[id(p)]
                raise ValueError(_two_groups(f"{first_region.label} ({first_name})", f"'{name}'"))


def _two_groups(first: str, second: str) -> str:
    return (
        f"{second} holds a parameter that {first} also holds: sharding by the region plan "
        "would put it in two FSDP2 groups and break the tie. Shard in configure_model(), "
        "or choose regions (regions=...) that own their parameters."
    )


def _child_groups(children: list[tuple[str, list[nn.Parameter]]]) -> list[list[str]]:
    """The children's names grouped so that children sharing a parameter are together."""
    groups: list[list[str]] = []
    group_of_param: dict[int, list[str]] = {}
    for name, params in children:
        joined: list[list[str]] = []
        for p in params:
            group = group_of_param.get(id(p))
            if group is not None and not any(group is other for other in joined):
                joined.append(group)
        group = joined[0] if joined else []
        if not joined:
            groups.append(group)
        for other in joined[1:]:  # this child ties two earlier groups together
            group.extend(other)
            groups = [g for g in groups if g is not other]
            group_of_param.update({k: group for k, g in group_of_param.items() if g is other})
        group.append(name)
        group_of_param.update({id(p): group for p in params})
    return groups


def _params_outside(
    module: nn.Module, region_ids: set[int], visited: set[int] | None = None
) -> Iterator[nn.Parameter]:
    """``module``'s parameters, not descending into regions (their group holds them)."""
    visited = set() if visited is None else visited
    if id(module) in region_ids or id(module) in visited:
        return
    visited.add(id(module))
    yield from (p for p in registered_parameters(module).values() if p is not None)
    for child in registered_children(module).values():
        if child is not None:
            yield from _params_outside(child, region_ids, visited)


def fsdp_data_parallel_size(root: nn.Module) -> int | None:
    """How many processes the FSDP2 groups under ``root`` shard (and replicate) over:
    the largest ``shard_mesh_size * replicate_mesh_size`` of any group, or None when
    nothing under ``root`` was sharded with ``fully_shard``."""
    sizes = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            info = group.mesh_info
            sizes.append(
                getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
            )
    return max(sizes, default=None)
