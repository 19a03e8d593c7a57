"""The background child, started by ``entry.py`` (``python .../entry.py FOLDER PARENT``).

It works in rounds, one child for the whole run. Round ``k`` reads
``FOLDER/shipment-k.pkl`` (written by the training process, in its own private folder),
compiles the regions by the shipped recipe and replays each recorded call with tensors
of the recorded metadata, forward and backward for a training call, into torch's caches
(the ``TORCHINDUCTOR_CACHE_DIR`` it inherits). Then it writes the cache artifacts of
everything it compiled in all its rounds (``torch.compiler.save_cache_artifacts``) to
``FOLDER/artifacts.bin`` for the job's other processes, with the paths of the C++ kernel
files it loaded and of torch's instruction-set probes (``cache.kernel_files_to_ship``)
in ``FOLDER/kernels.json``, and last ``FOLDER/result-k.json``: ``{"ok": true,
"seconds": ..., "peak_rss_mb": ..., "threads": ...}`` (its own peak resident memory,
the intra-op threads it compiled for), or ``{"ok":
false, "error": ...}``: failures are reported as data, as torch's compile workers do.
Then it waits for round ``k + 1``: calls recorded while it compiled (an epoch's smaller
last batch, a first validation) are compiled by the same child, which saves a second
start of Python and torch and keeps one child's memory in the run. It exits when the
training process stops it or is gone.

The training process starts it with its parallel work limited to the threads training
lends it (``background.lent_threads``); it compiles for the
training process's own intra-op thread count (``Shipment.threads``), the count inductor's
cache key holds.

One region's weights and activations exist at a time, each made on the device of its
recorded call just before the call and freed after it: the child never holds a copy of
the model.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cache import kernel_files_to_ship
from ..compat import inductor_cache_dir, tree_flatten
from ..core.regions import find_regions
from .shipment import RegionCall, Shipment, materialize, release, unpack

ARTIFACTS = "artifacts.bin"
KERNELS = "kernels.json"
LOG = "child.log"
#: How often a waiting child looks for its next round, in seconds.
POLL_S = 0.05


def shipment_file(where: Path, round: int) -> Path:
    """Where round ``round``'s shipment is written (whole, by a rename)."""
    return where / f"shipment-{round}.pkl"


def result_file(where: Path, round: int) -> Path:
    """Where round ``round``'s result is written (whole, by a rename, last of its files)."""
    return where / f"result-{round}.json"


def progress_file(where: Path, round: int) -> Path:
    """Where round ``round``'s progress is written after each call it replayed:
    ``{"done": k, "of": n}``."""
    return where / f"progress-{round}.json"


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees all of it or no file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


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


def compile_shipment(
    shipment: Shipment, progressed: Callable[[int, int], None] = lambda done, of: None
) -> dict[str, Any]:
    """Compile and replay everything ``shipment`` holds, into torch's caches, calling
    ``progressed(done, of)`` after each call replayed."""
    shipment.recipe.enter_settings()
    torch.set_num_threads(shipment.threads)  # the training process's: the cache key's
    holder = nn.Module()
    holder.regions = nn.ModuleList(shipment.regions)
    plan = find_regions(holder, [f"regions.{index}" for index in range(len(shipment.regions))])
    shipment.recipe.compile(holder, plan, root_is_called=True)
    start = time.perf_counter()
    replays = orders(shipment.calls)
    done, of = 0, sum(len(calls) for calls in replays)
    for calls in replays:
        torch.compiler.reset()  # each order from a fresh dynamo, as in the training process
        for call in calls:
            region = holder.regions[call.index]
            materialize([region], call.device)
            try:
                replay(region, call)
            finally:
                release([region])
            done += 1
            progressed(done, of)
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


def one_round(where: Path, round: int) -> dict[str, Any]:
    """Compile round ``round``'s shipment and write its files; its result."""
    try:
        shipment = unpack(shipment_file(where, round).read_bytes())
        progress = progress_file(where, round)
        result = compile_shipment(
            shipment,
            lambda done, of: write_whole(progress, json.dumps({"done": done, "of": of}).encode()),
        )
        saved = torch.compiler.save_cache_artifacts()  # every round's, so far
        if saved is not None:
            write_whole(where / ARTIFACTS, saved[0])
        kernels = sorted(kernel_files_to_ship(inductor_cache_dir()))
        write_whole(where / KERNELS, json.dumps(kernels).encode())
    except BaseException as error:  # every failure goes back to the training process
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
    result["peak_rss_mb"] = peak_rss_mb()
    result["threads"] = torch.get_num_threads()  # the count its kernels were made for
    write_whole(result_file(where, round), json.dumps(result).encode())
    return result


def main(folder: str, parent: int) -> int:
    """Compile rounds in ``folder`` until stopped, or until ``parent`` (the training
    process's pid, passed by it: it may be gone before this process reads its own) is."""
    where = Path(folder)
    watch_parent(parent)
    for round in itertools.count(1):
        while not shipment_file(where, round).exists():
            time.sleep(POLL_S)
        if not one_round(where, round).get("ok"):
            return 1
    return 0
