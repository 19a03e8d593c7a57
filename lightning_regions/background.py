"""Compile in the background: training starts at once with the regions eager, while a
child process compiles them into torch's shared on-disk caches; at a step boundary the
strategy compiles them in place, and that compile is a warm one.

- **Capture.** During the first training step a forward pre-hook on each distinct region
  records its first call: the metadata of every tensor argument (shape, stride, dtype,
  device, requires-grad), the plain values of the others, grad mode and autocast.
- **Ship.** After the first optimizer step each region is copied with its parameters and
  buffers on the ``meta`` device (the structure, no weights) and saved with the calls
  and the compile arguments to a private folder; ``python -m
  lightning_regions.background`` compiles them there: the same regions, by the same
  plan, called in the same order with tensors of the same metadata, forward and
  backward, into the same ``TORCHINDUCTOR_CACHE_DIR``.
- **Switch.** At each optimizer step the strategy asks whether the child is done (under
  DDP every rank agrees, so all switch at the same step); then it compiles the regions
  in place as the default mode would, reading torch's FX-graph and AOTAutograd caches.

What cannot be shipped (a class defined in ``__main__`` or a function, an argument that
is not a tensor or a plain value), a child that fails, and one that runs past
``background_timeout_s`` are warned about once, naming the region or the cause; the
regions then compile in the training process at that step boundary, as in the default
mode. No child outlives the strategy's teardown (or its process).
"""

from __future__ import annotations

import atexit
import copy
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compat import dynamo_config, tree_flatten, tree_unflatten
from .regions import RegionPlan


class BackgroundCompileWarning(UserWarning):
    """The background compile could not run or finish; the regions compile in the
    training process at a step boundary instead."""


#: Plain values an argument may be, shipped as they are.
PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class Unshippable(Exception):
    """What keeps a region's call from being reproduced in another process."""


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
        made = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if made.is_floating_point():
            made.normal_()
        else:
            made.zero_()
        return made.requires_grad_(self.requires_grad)


@dataclass
class RegionCall:
    """One region's first call in training, as the child replays it."""

    index: int  # the region's place in the plan
    order: int  # when it was called, among the regions' first calls
    args: Any  # the pytree of (args, kwargs) with TensorSpec leaves
    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) turned on


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
            raise Unshippable(f"an argument of type {type(leaf).__name__}")
    return tree_unflatten(described, spec)


def made_call(described: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves, spec = tree_flatten(described)
    args, kwargs = tree_unflatten(
        [leaf.make() if isinstance(leaf, TensorSpec) else leaf for leaf in leaves], spec
    )
    return args, kwargs


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    on = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            on.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(on)


def structural_copy(module: nn.Module) -> nn.Module:
    """``module`` with its parameters and buffers on the ``meta`` device: what the child
    needs to trace it, without its weights."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(module, memo)


def check_shippable(module: nn.Module) -> None:
    """Raise ``Unshippable`` for a region the child could not import or unpickle."""
    cls = type(module)
    for inner in module.modules():
        owner = type(inner)
        if owner.__module__ == "__main__" or "<locals>" in owner.__qualname__:
            raise Unshippable(
                f"{owner.__qualname__} is defined in {owner.__module__} (a script, a notebook "
                "or a function), which another process cannot import"
            )
    try:
        torch.save(module, io.BytesIO())
    except Exception as error:  # pickling runs the user's code: any error means "cannot"
        raise Unshippable(f"{cls.__name__} cannot be pickled: {error}") from error


@dataclass
class BackgroundCompile:
    """One setup's background compile: capture, ship, poll, and clean up."""

    timeout_s: float
    plan: RegionPlan | None = None
    calls: dict[int, RegionCall] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    folder: tempfile.TemporaryDirectory[str] | None = None
    started: float = 0.0
    failure: str = ""  # why the regions compile in the training process instead
    steps_eager: int = 0  # optimizer steps that ran before the switch
    switched: bool = False
    child_seconds: float | None = None

    def capture(self, plan: RegionPlan) -> None:
        """Record each region's first training call from now on."""
        self.plan = plan
        order = itertools.count()
        for index, region in enumerate(plan.regions):

            def record(module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
                if index in self.calls or not module.training or self.failure:
                    return
                try:
                    described = describe_call(args, kwargs)
                except Unshippable as error:
                    self.failure = f"{plan.regions[index].label}: {error}"
                    return
                self.calls[index] = RegionCall(
                    index, next(order), described, torch.is_grad_enabled(), autocast_state()
                )

            self.hooks.append(region.module.register_forward_pre_hook(record, with_kwargs=True))

    def _remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def ship(self, compile_options: dict[str, Any]) -> None:
        """Start the child on what the first step recorded (or note why not)."""
        self._remove_hooks()
        assert self.plan is not None
        if self.failure:
            return
        if len(self.calls) < len(self.plan.regions):
            missing = [r.label for i, r in enumerate(self.plan.regions) if i not in self.calls]
            self.failure = f"not called in the first training step: {', '.join(missing[:3])}"
            return
        try:
            for region in self.plan.regions:
                check_shippable(region.module)
            copies = [structural_copy(region.module) for region in self.plan.regions]
        except Unshippable as error:
            self.failure = str(error)
            return
        self.folder = tempfile.TemporaryDirectory(prefix="lightning_regions_background_")
        payload = Path(self.folder.name) / "payload.pt"
        torch.save(
            {
                "regions": copies,
                "class_names": sorted({region.class_name for region in self.plan.regions}),
                "calls": [self.calls[index] for index in range(len(copies))],
                "options": compile_options,
                "unspec_ints": bool(dynamo_config().allow_unspec_int_on_nn_module),
                "parent": os.getpid(),
            },
            payload,
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        with open(Path(self.folder.name) / "child.log", "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lightning_regions.background", str(payload)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.started = time.perf_counter()
        atexit.register(self.stop)  # Fabric has no teardown: at the latest, at exit

    def ready(self) -> bool:
        """Whether this process can switch now: the child finished (well or not), ran
        past the limit, or never started."""
        if self.switched:
            return True
        if self.process is None:
            return True
        code = self.process.poll()
        if code is None:
            if time.perf_counter() - self.started <= self.timeout_s:
                return False
            self.failure = f"still compiling after background_timeout_s={self.timeout_s:g}"
            self.stop()
            return True
        result = Path(self.folder.name) / "result.json" if self.folder else None
        done = json.loads(result.read_text()) if result and result.exists() else {}
        if code != 0 or not done.get("ok"):
            tail = ""
            if self.folder:
                text = (Path(self.folder.name) / "child.log").read_text(errors="replace")
                tail = (text.strip().splitlines() or [""])[-1]
            self.failure = done.get("error") or f"the child exited with {code}: {tail}"
        self.child_seconds = done.get("seconds")
        self.process = None
        return True

    def warn_if_failed(self) -> None:
        if self.failure:
            warnings.warn(
                f"Background compile did not run: {self.failure}. The regions compile in "
                "the training process now, at this step boundary, as in the default mode.",
                BackgroundCompileWarning,
                stacklevel=3,
            )

    def stop(self) -> None:
        """End the child, if any, and remove the hooks and the folder."""
        self._remove_hooks()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None
        atexit.unregister(self.stop)


def compile_shipped(payload: Path) -> dict[str, Any]:
    """In the child: compile what the training process shipped, into torch's caches."""
    from .compile import compile_regions

    shipped = torch.load(payload, weights_only=False)
    _watch_parent(shipped["parent"])
    dynamo_config().allow_unspec_int_on_nn_module = shipped["unspec_ints"]
    regions: list[nn.Module] = shipped["regions"]
    for region, call in zip(regions, shipped["calls"], strict=True):
        device = _device_of(call)
        region.to_empty(device=device)
    holder = nn.Module()
    holder.regions = nn.ModuleList(regions)
    options = dict(shipped["options"])
    compile_regions(
        holder,
        inplace=True,
        regions=shipped["class_names"],
        observe_calls=None,  # as the strategies observe: the same call path
        root_is_called=True,
        **options,
    )
    start = time.perf_counter()
    for call in sorted(shipped["calls"], key=lambda call: call.order):
        args, kwargs = made_call(call.args)
        with torch.set_grad_enabled(call.grad_enabled), _autocast(call.autocast):
            output = regions[call.index](*args, **kwargs)
        leaves = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if leaves:
            sum(t.float().sum() for t in leaves).backward()  # type: ignore[union-attr]
    return {"ok": True, "seconds": time.perf_counter() - start}


def _device_of(call: RegionCall) -> str:
    leaves = [leaf for leaf in tree_flatten(call.args)[0] if isinstance(leaf, TensorSpec)]
    return leaves[0].device if leaves else "cpu"


class _autocast:
    def __init__(self, state: tuple[tuple[str, torch.dtype], ...]) -> None:
        self.contexts = [torch.autocast(device, dtype=dtype) for device, dtype in state]

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc)


def _watch_parent(parent: int) -> None:
    """End this child when the training process is gone."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(payload: str) -> int:
    path = Path(payload)
    try:
        result = compile_shipped(path)
    except BaseException as error:  # report everything to the training process
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
    (path.parent / "result.json").write_text(json.dumps(result))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    # run as the package's module, so the shipped objects' classes are this module's
    from lightning_regions.background import main as shipped_main

    sys.exit(shipped_main(sys.argv[1]))
