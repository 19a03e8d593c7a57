"""What crosses from the training process to the background child, and nothing more.

- **Structure.** The regions, copied together with every parameter, buffer and plain
  tensor attribute on the ``meta`` device (``structural_copy``): shapes, dtypes and
  ties, no values. Pickled with ``cloudpickle``, so a class written in the training
  script, a notebook cell or a function travels by value, as joblib's ``loky`` ships
  work; a class in an importable module travels by reference.
- **Calls.** Each region's first call of each kind (training, evaluation without grad,
  under inference mode or autocast: ``CallKind``), with every tensor argument as its
  metadata (``TensorSpec``) and the other arguments as plain values.
- **The recipe.** ``recipe.CompileRecipe``: the regional options and torch's dynamo
  and inductor settings in effect in the training process.

What cannot cross is named (``Unshippable``): an object that no pickler can copy (a
lock, an open file, a socket, a process group handle, a generator) held by a region
or by a hook on it, and an argument that is neither a tensor nor a plain value.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Iterator, Set
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from torch import nn

from ..compat import (
    registered_buffers,
    registered_parameters,
    remove_forward_pre_hooks,
    tree_flatten,
    tree_unflatten,
)

#: Plain values an argument may be, shipped as they are.
PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class Unshippable(Exception):
    """What keeps a region or its call from being reproduced in another process."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument's metadata: what dynamo guards on, not its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            str(tensor.device),
            tensor.requires_grad,
        )

    def make(self) -> torch.Tensor:
        """A tensor of this metadata with arbitrary values (normal floats, zero ints)."""
        made = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if made.is_floating_point() or made.is_complex():
            made.normal_()
        else:
            made.zero_()
        return made.requires_grad_(self.requires_grad)


@dataclass(frozen=True)
class CallKind:
    """What a region's call is traced under, besides its arguments: each kind compiles
    graphs of its own (a training call forward and backward, an evaluation call its
    forward alone)."""

    training: bool
    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) turned on

    @classmethod
    def now(cls, module: nn.Module) -> CallKind:
        """The kind of a call of ``module`` made now."""
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        )
        return cls(
            module.training,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast,
        )

    @property
    def trains(self) -> bool:
        """A training call (forward and backward), not an evaluation one."""
        return self.training and self.grad_enabled

    @contextlib.contextmanager
    def entered(self, module: nn.Module) -> Iterator[None]:
        """``module`` in this kind's mode (each submodule's own mode back afterwards; a
        module already in it keeps its submodules' own, a frozen norm's say), with grad
        mode, inference mode and autocast as they were at the call."""
        modes = [(inner, inner.training) for inner in module.modules()]
        if module.training != self.training:
            module.train(self.training)
        try:
            with contextlib.ExitStack() as stack:
                if self.inference_mode:
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
                for device, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
                yield
        finally:
            for inner, training in modes:
                inner.training = training

    def __str__(self) -> str:
        return "training" if self.trains else "evaluation"


@dataclass
class RegionCall:
    """One region's call of one kind, as the child replays it: the first, or a later one
    whose arguments' metadata differ (``signature`` 2)."""

    index: int  # the region's place in the plan
    order: int  # when it was called, among all recorded calls
    kind: CallKind
    args: Any  # the pytree of (args, kwargs) with TensorSpec leaves
    signature: int = 1  # which of its kind's distinct signatures, in the order seen

    @property
    def device(self) -> str:
        specs = [leaf for leaf in tree_flatten(self.args)[0] if isinstance(leaf, TensorSpec)]
        return specs[0].device if specs else "cpu"

    def made(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with a made tensor for each spec."""
        leaves, spec = tree_flatten(self.args)
        return tree_unflatten(
            [leaf.make() if isinstance(leaf, TensorSpec) else leaf for leaf in leaves], spec
        )


def describe_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(args, kwargs)`` with every tensor as a ``TensorSpec``; raises ``Unshippable``
    for a value that is neither a tensor nor plain."""
    leaves, spec = tree_flatten((args, kwargs))
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(TensorSpec.of(leaf))
        elif isinstance(leaf, PLAIN):
            described.append(leaf)
        else:
            raise Unshippable(
                f"an argument of type {type(leaf).__name__}, neither a tensor nor a plain value"
            )
    return tree_unflatten(described, spec)


def call_signature(described: Any) -> tuple[Any, ...]:
    """What dynamo guards on in a described call (``describe_call``): its structure and
    every leaf, each tensor's metadata and each plain value."""
    leaves, spec = tree_flatten(described)
    return (str(spec), *leaves)


def _tensors_of(modules: list[nn.Module]) -> Iterator[torch.Tensor]:
    """Every parameter, buffer and plain tensor attribute of ``modules``' trees."""
    for root in modules:
        for module in root.modules():
            yield from (t for t in registered_parameters(module).values() if t is not None)
            yield from (t for t in registered_buffers(module).values() if t is not None)
            yield from (t for t in vars(module).values() if isinstance(t, torch.Tensor))


def structural_copy(
    modules: list[nn.Module], without_hooks: Set[int] = frozenset()
) -> list[nn.Module]:
    """``modules`` copied together with every tensor they hold on the ``meta`` device:
    the structure the child traces, without a value. Tensors shared between them stay
    shared; nothing is read from the device. The forward pre-hooks whose handle ids are
    ``without_hooks`` (the background compile's own recorders) are not copied."""
    memo: dict[int, Any] = {}
    for tensor in _tensors_of(modules):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    copies = copy.deepcopy(modules, memo)
    for root in copies:
        for module in root.modules():
            remove_forward_pre_hooks(module, set(without_hooks))
    return copies


def _replace_tensors(modules: list[nn.Module], replace: Any) -> None:
    """Put ``replace(tensor)`` (or the tensor itself, where it returns None) in every
    parameter, buffer and plain tensor attribute slot of ``modules``' trees, once per
    tensor: what was shared stays shared."""
    made: dict[int, torch.Tensor] = {}

    def new(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            replaced = replace(tensor)
            made[id(tensor)] = tensor if replaced is None else replaced
        return made[id(tensor)]

    for root in modules:
        for module in root.modules():
            for slots in (registered_parameters(module), registered_buffers(module)):
                for name, tensor in slots.items():
                    if tensor is not None:
                        slots[name] = new(tensor)  # type: ignore[assignment]
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    vars(module)[name] = new(value)


def _like(tensor: torch.Tensor, made: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    return made


def materialize(modules: list[nn.Module], device: str) -> None:
    """Give every ``meta`` tensor of ``modules`` (made by ``structural_copy``) storage on
    ``device`` and arbitrary values (small normal floats, zero ints)."""

    def real(tensor: torch.Tensor) -> torch.Tensor | None:
        if not tensor.is_meta:
            return None
        made = torch.empty_like(tensor, device=device)
        made = made.normal_(std=0.02) if made.is_floating_point() else made.zero_()
        return _like(tensor, made)

    _replace_tensors(modules, real)


def release(modules: list[nn.Module]) -> None:
    """Put every tensor of ``modules`` back on ``meta``: their storage is freed."""

    def meta(tensor: torch.Tensor) -> torch.Tensor | None:
        return None if tensor.is_meta else _like(tensor, torch.empty_like(tensor, device="meta"))

    _replace_tensors(modules, meta)


@dataclass
class Shipment:
    """Everything the child gets: structure, calls and the recipe, no weights."""

    regions: list[nn.Module]  # on meta, in the plan's order
    calls: list[RegionCall]
    recipe: Any  # recipe.CompileRecipe
    #: The training process's intra-op threads after the switch: CPU kernels are made
    #: for that count, and inductor's cache key holds it.
    threads: int


def pack(shipment: Shipment) -> bytes:
    """``shipment`` as bytes (``cloudpickle``); ``Unshippable`` when that fails (a region
    that cannot cross is found beforehand by ``shippable_copies``)."""
    try:
        return cloudpickle.dumps(shipment)
    except Exception as error:  # pickling runs the user's code: any error means "cannot"
        raise Unshippable(f"the compile recipe or a call cannot be pickled: {error}") from error


def shippable_copies(
    modules: list[nn.Module], without_hooks: Set[int] = frozenset()
) -> tuple[dict[int, nn.Module], dict[int, str]]:
    """Structural copies (``structural_copy``, made together) of those of ``modules``
    that can cross to another process, by index; for each of the others, why not."""
    refused = {}
    for index, module in enumerate(modules):
        try:
            cloudpickle.dumps(structural_copy([module], without_hooks))
        except Exception as error:  # copying and pickling run the user's code: anything
            refused[index] = f"{type(error).__name__}: {error}"
    kept = [index for index in range(len(modules)) if index not in refused]
    copies = structural_copy([modules[index] for index in kept], without_hooks)
    return dict(zip(kept, copies, strict=True)), refused


def unpack(data: bytes) -> Shipment:
    """The shipment ``pack`` made (in the child: our own file, in our own folder)."""
    shipment = pickle.loads(data)
    if not isinstance(shipment, Shipment):
        raise TypeError(f"not a shipment: {type(shipment).__name__}")
    return shipment
