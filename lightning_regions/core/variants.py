"""Variants: instances of one region class that differ by design, known before compiling.

Repeated blocks are often not all alike: T5's block 0 owns the relative attention bias,
ModernBERT's layer 0 has ``Identity`` where the others have a ``LayerNorm``, DeepSeek's
first layers have a dense MLP and the rest a MoE, Gemma-style layers alternate
``is_sliding``. torch compiles one graph per such variant, and that is expected, not a
recompile to warn about. ``find_variants`` groups each class's instances by what their
``forward`` can see that differs:

- the class, or absence, of the child registered at each path (``None`` included);
- the shape of each parameter and buffer;
- plain attribute values (bool, int, float, str, ``None``) that take a few values across
  the instances (at most ``max(2, instances // 4)``). A value that takes many (a layer
  index, a per-layer rate, even repeated across two stacks) is not a variant: it is a
  per-instance number, which the report judges on its own.

Plain torch, from the plan alone: nothing is compiled or called.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..compat import registered_buffers, registered_parameters
from .graph import compress_paths, iter_registrations, join, model_class
from .regions import Region, RegionPlan

#: An attribute makes variants when it takes at most max(FEW, instances // 4) values.
FEW = 2
#: Plain attribute types whose values can make a variant.
PLAIN = (bool, int, float, str, type(None))
#: At most this many differences are named per variant.
SHOWN_DIFFERENCES = 3


@dataclass(frozen=True)
class Variant:
    """Instances of one class that look alike to ``forward``, and how they differ from
    the class's other variants (``path: value`` items)."""

    paths: tuple[str, ...]  # each instance's first path
    differences: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        shown = ", ".join(f"{key}: {value}" for key, value in self.differences[:SHOWN_DIFFERENCES])
        more = len(self.differences) - SHOWN_DIFFERENCES
        extra = f", and {more} more" if more > 0 else ""
        return f"{compress_paths(self.paths)} ({shown}{extra})"


@dataclass(frozen=True)
class ClassVariants:
    """The variants of one region class, in first-instance order."""

    class_name: str
    variants: tuple[Variant, ...]

    def variant_of(self, path: str) -> int:
        """The index of the variant whose instances include ``path``."""
        return next(i for i, variant in enumerate(self.variants) if path in variant.paths)

    def __str__(self) -> str:
        listed = "; ".join(str(variant) for variant in self.variants)
        return f"{self.class_name}: {len(self.variants)} variant(s): {listed}"


#: The kinds of feature, in the order differences are named.
MODULE, TENSOR, ATTRIBUTE = "module", "tensor", "attribute"


def features(module: nn.Module) -> dict[str, tuple[str, str]]:
    """What ``forward`` can see of ``module`` that may differ between instances, as
    ``path: (kind, value)``: the class of every registration, the shape of every
    parameter and buffer, the value of every plain attribute."""
    found: dict[str, tuple[str, str]] = {}
    for path, child in iter_registrations(module):
        if path:
            found[path] = (MODULE, "None" if child is None else model_class(child).__name__)
        if child is None:
            continue
        for tensors in (registered_parameters(child), registered_buffers(child)):
            for name, tensor in tensors.items():
                shape = "None" if tensor is None else str(tuple(tensor.shape))
                found[join(path, name)] = (TENSOR, shape)
        for name, value in vars(child).items():
            if not name.startswith("_") and name != "training" and isinstance(value, PLAIN):
                found[join(path, name)] = (ATTRIBUTE, repr(value))
    return found


def find_variants(plan: RegionPlan) -> dict[str, ClassVariants]:
    """Each region class's variants (a class of one variant too), by class name."""
    by_class: dict[str, list[Region]] = {}
    for region in (*plan.regions, *plan.nested):
        by_class.setdefault(region.class_name, []).append(region)
    return {name: class_variants(name, regions) for name, regions in by_class.items()}


def class_variants(class_name: str, regions: list[Region]) -> ClassVariants:
    """Group ``regions`` (instances of one class) by the features that make variants."""
    seen = [features(region.module) for region in regions]
    kinds = {key: kind for found in seen for key, (kind, _) in found.items()}
    values = [{key: value for key, (_, value) in found.items()} for found in seen]
    varying = [
        key
        for key in sorted(kinds)
        if _makes_variants(kinds[key], [found.get(key, "absent") for found in values])
    ]
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, found in enumerate(values):
        groups.setdefault(tuple(found.get(key, "absent") for key in varying), []).append(index)
    variants = []
    for signature, members in groups.items():
        mine = dict(zip(varying, signature, strict=True))
        others = [dict(zip(varying, other, strict=True)) for other in groups if other != signature]
        differing = [key for key in varying if any(other[key] != mine[key] for other in others)]
        differences = [(key, mine[key]) for key in _named(differing, kinds)]
        variants.append(Variant(tuple(regions[i].paths[0] for i in members), tuple(differences)))
    return ClassVariants(class_name, tuple(variants))


def _makes_variants(kind: str, values: list[str]) -> bool:
    """A child or tensor that differs always makes variants; an attribute only when it
    takes a few values (many are a per-instance number)."""
    distinct = len(set(values))
    if distinct == 1:
        return False
    return kind != ATTRIBUTE or distinct <= max(FEW, len(values) // 4)


def _named(differing: list[str], kinds: dict[str, str]) -> list[str]:
    """The differences worth naming, children first, shallow first: a child's own
    parameters and attributes are left out when the child itself differs."""
    modules = [key for key in differing if kinds[key] == MODULE]
    kept = [key for key in differing if not any(key.startswith(f"{m}.") for m in modules)]
    order = {MODULE: 0, ATTRIBUTE: 1, TENSOR: 2}
    return sorted(kept, key=lambda key: (order[kinds[key]], key.count("."), key))
