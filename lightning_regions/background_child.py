"""The background child: ``python -m lightning_regions.background_child FOLDER``.

It reads ``FOLDER/shipment.pkl`` (written by the training process, in its own private
folder), compiles the regions by the shipped recipe and replays each recorded call with
tensors of the recorded metadata, forward and backward for a training call, into
torch's caches (the ``TORCHINDUCTOR_CACHE_DIR`` it inherits). Then it writes the cache
artifacts of everything it compiled (``torch.compiler.save_cache_artifacts``) to
``FOLDER/artifacts.bin`` for the job's other processes, with the paths of the C++ kernel
files it loaded and of torch's instruction-set probes (``cache.kernel_files_to_ship``)
in ``FOLDER/kernels.json``, and ``FOLDER/result.json``: ``{"ok": true, "seconds": ...,
"peak_rss_mb": ...}`` (its own peak resident memory), or ``{"ok": false, "error": ...}``:
failures are reported as data, as torch's compile workers do. It exits when the
training process is gone.

One region's weights and activations exist at a time, each made on the device of its
recorded call just before the call and freed after it: the child never holds a copy of
the model.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .cache import kernel_files_to_ship
from .compat import inductor_cache_dir, tree_flatten
from .regions import find_regions
from .shipment import RegionCall, Shipment, materialize, release, unpack

SHIPMENT = "shipment.pkl"
ARTIFACTS = "artifacts.bin"
KERNELS = "kernels.json"
RESULT = "result.json"
LOG = "child.log"


def replay(region: nn.Module, call: RegionCall) -> None:
    """Call ``region`` as recorded; backward through what a training call returns."""
    args, kwargs = call.made()
    with call.kind.entered(region):
        output = region(*args, **kwargs)
        if not call.kind.grad_enabled:
            return
        needing_grad = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if needing_grad:
            torch.autograd.backward(needing_grad, [torch.ones_like(t) for t in needing_grad])


def compile_shipment(shipment: Shipment) -> dict[str, Any]:
    """Compile and replay everything ``shipment`` holds, into torch's caches."""
    shipment.recipe.enter_settings()
    holder = nn.Module()
    holder.regions = nn.ModuleList(shipment.regions)
    plan = find_regions(holder, [f"regions.{index}" for index in range(len(shipment.regions))])
    shipment.recipe.compile(holder, plan, root_is_called=True)
    start = time.perf_counter()
    for calls in orders(shipment.calls):
        torch.compiler.reset()  # each order from a fresh dynamo, as in the training process
        for call in calls:
            region = holder.regions[call.index]
            materialize([region], call.device)
            try:
                replay(region, call)
            finally:
                release([region])
        torch.compiler.reset()
    return {"ok": True, "seconds": time.perf_counter() - start}


def orders(calls: list[RegionCall]) -> list[list[RegionCall]]:
    """The orders to replay ``calls`` in: the order the training process calls them in
    after the switch, from a fresh dynamo. Which graphs dynamo compiles depends on it: the
    first call of a code object is compiled static, a later one whose shapes differ from
    what it saw dynamic. After the switch the training process first replays the
    evaluation calls (``BackgroundCompile.warm_evaluation``), in the order recorded; then
    training goes on with whichever batch comes next: so one order per training
    signature, that signature's calls first."""
    recorded = sorted(calls, key=lambda call: call.order)
    evaluation = [call for call in recorded if not call.kind.trains]
    training = [call for call in recorded if call.kind.trains]
    firsts = sorted({call.signature for call in training}) or [1]
    return [
        evaluation + sorted(training, key=lambda call: (call.signature != first, call.order))
        for first in firsts
    ]


def watch_parent(parent: int) -> None:
    """End this process when the training process is gone."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def peak_rss_mb() -> float:
    """This process's own peak resident memory so far, in MiB: Linux's ``VmHWM``, the
    high-water mark of its own address space. Not ``getrusage``'s ``ru_maxrss``: ``exec``
    carries the old address space's mark into it, and a child spawned by the training
    process starts from that process's peak (measured at width 1024, depth 6: 1646 MiB
    reported for a child whose own peak was 631). Where ``/proc`` is missing,
    ``ru_maxrss``: an upper bound."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(folder: str) -> int:
    where = Path(folder)
    try:
        shipment = unpack((where / SHIPMENT).read_bytes())
        watch_parent(shipment.parent)
        result = compile_shipment(shipment)
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            (where / ARTIFACTS).write_bytes(saved[0])
        kernels = sorted(kernel_files_to_ship(inductor_cache_dir()))
        (where / KERNELS).write_text(json.dumps(kernels))
    except BaseException as error:  # every failure goes back to the training process
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
    result["peak_rss_mb"] = peak_rss_mb()
    (where / RESULT).write_text(json.dumps(result))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    # run as the package's module, so that shipped objects' classes are this module's
    from lightning_regions.background_child import main as child_main

    sys.exit(child_main(sys.argv[1]))
