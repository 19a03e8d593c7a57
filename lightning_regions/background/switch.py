"""Compile in the background: the one home of the switch.

Training starts with the regions eager while one child process in the whole job
compiles them into torch's caches; at a step boundary where every process agrees, each
compiles its regions in place by the same recipe, warm. The strategy makes a
``BackgroundCompile`` at setup, calls ``at_step_boundary`` after each optimizer step
until it says "compile now", and ``stop`` at teardown. Nothing else of the mode lives
in the strategy.

1. **Capture.** A forward pre-hook on each distinct region records its first call of
   each kind (``shipment.CallKind``: training, or evaluation in the sanity check or a
   validation loop), as metadata.
2. **Ship** (global rank 0, from the first optimizer step on, whenever the child is not
   compiling and calls wait). The regions' structure on ``meta``, the calls and the
   recipe go to a private folder (``shipment.pack``: ``cloudpickle``, so classes of a
   script, a notebook or a function travel by value); ``python -m
   lightning_regions.background.child`` compiles and replays them there. One child per
   run: calls recorded while it compiles (an epoch's smaller last batch) are its next
   round, not a second process's. A region that cannot be shipped is named once and
   compiles in the training process at the switch; the rest still ship.
3. **Agree.** At every optimizer step each process says whether it is ready (rank 0:
   its child is done, failed or past ``background_timeout_s``; the others always), in
   one all-reduce, so that every process switches at the same step and none waits on a
   compile: until then they train eager.
4. **Switch.** Rank 0 sends the child's cache artifacts, signed as in checkpoints
   (``cache.sign_artifacts``), over the job's process group; every other process loads
   them into its own cache (refused ones: one warning, and that process compiles
   cold); then every process compiles in place and the next step reads the caches.

A child that fails or runs past its limit is one ``BackgroundCompileWarning``, and the
regions compile in the training process at that step boundary, as in the default mode.
No child outlives ``stop`` (the strategy's teardown, also after an exception) or its
training process.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..cache import sign_artifacts, unpack_artifacts
from ..compat import cache_counts, inductor_cache_dir
from ..core.recipe import CompileRecipe
from ..core.regions import RegionPlan
from .child import (
    ARTIFACTS,
    KERNELS,
    LOG,
    progress_file,
    result_file,
    shipment_file,
    write_whole,
)
from .shipment import (
    CallKind,
    RegionCall,
    Shipment,
    Unshippable,
    call_signature,
    describe_call,
    pack,
    shippable_copies,
)
from .threads import IntraOpThreads, limit_intra_op_threads, restore_intra_op_threads

#: Calls recorded per region and kind of call: the first, and the first whose arguments
#: metadata differ from it (dynamo compiles a static graph, then on a change of shape, a
#: variable last batch say, a dynamic one that covers later changes).
SIGNATURES_PER_KIND = 2
#: Where the other processes' artifacts come from, as their warnings say.
SOURCE = "the background compile on global rank 0"
#: A recorded call: its region's index, its kind, and which of the kind's signatures.
CallKey = tuple[int, CallKind, int]
#: glibc's ``malloc`` settings for the child, unless the user set them. A fixed threshold
#: (1 MiB) above which a block is its own ``mmap``, returned to the system when freed.
#: glibc's default threshold moves up to the largest block freed so far, so a region's
#: weights freed after its call are kept in the heap, fragmented, and the child's peak
#: grew with depth: +34 MiB from depth 2 to 6 at width 1024 (one block's weights: 48 MiB)
#: with the default, +0 MiB and a 44 MiB lower peak with this one
#: (``benchmarks/results/memory.md``).
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def kept_threads(threads: int) -> int:
    """The intra-op threads a process with ``threads`` keeps while its child compiles."""
    return max(1, threads // 2)


def lent_threads(threads: int) -> int:
    """The cores the child's parallel work may use at once, beside a process with
    ``threads`` intra-op threads: those it does not keep, at least one. The child's own
    intra-op thread count stays ``threads`` (``Shipment.threads``), the count inductor's
    cache key holds; the limit keeps each of its parallel ops from waiting for a thread
    on a core that training holds (``OMP_THREAD_LIMIT``: with 2 threads beside a
    one-thread training process and at the lowest CPU priority, the child's compile took
    64 s instead of 32). The child keeps the normal priority: at the lowest, a machine
    busy with other work starves it (``docs/background.md``)."""
    return max(1, threads - kept_threads(threads))


class BackgroundCompileWarning(UserWarning):
    """The background compile could not run or finish for some regions; they compile in
    the training process at the switch instead."""


class Processes(Protocol):
    """What the mode needs of a strategy (Trainer's or Fabric's): who ships, and how
    the processes agree and share."""

    @property
    def is_global_zero(self) -> bool: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


@dataclass
class Child:
    """The run's one background child process, its private folder and its rounds: each
    shipment is one round, compiled by the same process (``background_child``)."""

    folder: tempfile.TemporaryDirectory[str]
    process: subprocess.Popen[bytes]
    round: int = 1  # the round shipped last
    reported: bool = False  # whether that round's result was taken
    started: float = field(default_factory=time.perf_counter)  # the round's start
    threads: int | None = None  # the intra-op threads it compiled for, as it reported
    peak_rss_mb: float | None = None  # its highest peak resident memory reported, in MiB

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(cls, shipment: bytes, threads: int) -> Child:
        """Start the child on its first round; ``threads``: the cores its parallel work
        may use at once (``OMP_THREAD_LIMIT``, unless the user set it)."""
        folder = tempfile.TemporaryDirectory(prefix="lightning_regions_background_")
        where = Path(folder.name)
        write_whole(shipment_file(where, 1), shipment)
        env = {**CHILD_MALLOC, "OMP_THREAD_LIMIT": str(threads), **os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        with open(where / LOG, "wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("entry.py")),  # not the package's __init__
                    str(where),
                    str(os.getpid()),  # the child watches this process
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return cls(folder, process)

    def ship(self, shipment: bytes) -> None:
        """Give the child its next round (after the last one's result was taken)."""
        self.round += 1
        self.reported = False
        self.started = time.perf_counter()
        write_whole(shipment_file(self.where, self.round), shipment)

    @property
    def where(self) -> Path:
        return Path(self.folder.name)

    @property
    def busy(self) -> bool:
        """Whether the last round is still compiling (its result not written, the child
        alive)."""
        done = result_file(self.where, self.round).exists() or self.process.poll() is not None
        return not self.reported and not done

    def result(self) -> dict[str, Any]:
        """What the child reported of its last round; a child that died without a report
        is named by its exit status and the last line of its log."""
        self.reported = True
        path = result_file(self.where, self.round)
        done = json.loads(path.read_text()) if path.exists() else {}
        if not done.get("ok") and not done.get("error"):
            code = self.process.wait()
            text = (self.where / LOG).read_text(errors="replace").strip().splitlines()
            last = f": {text[-1]}" if text else ""
            done = {
                "ok": False,
                "error": f"the child was killed by signal {-code}"
                if code < 0
                else f"the child exited with {code}{last}",
            }
        return done

    def progress(self) -> tuple[int, int] | None:
        """The calls of its last round replayed so far, and of how many (None before the
        first, or where its file cannot be read)."""
        try:
            done = json.loads(progress_file(self.where, self.round).read_text())
            return int(done["done"]), int(done["of"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def artifacts(self) -> tuple[bytes, dict[str, bytes]] | None:
        """The cache artifacts of what the child compiled in all its rounds, and the
        kernel files it loaded (read from the cache directory it shares with this
        process)."""
        path, kernels = self.where / ARTIFACTS, self.where / KERNELS
        if not path.exists():
            return None
        root = Path(inductor_cache_dir())
        names = json.loads(kernels.read_text()) if kernels.exists() else []
        files = {name: (root / name).read_bytes() for name in names if (root / name).is_file()}
        return path.read_bytes(), files

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.folder.cleanup()


@dataclass
class Outcome:
    """What rank 0 tells every process at the switch."""

    failure: str = ""  # why the regions compile in the training process instead
    unshipped: tuple[str, ...] = ()  # regions that compile there, each with its reason
    artifacts: tuple[dict[str, Any], ...] = ()  # the last child's (none or one), signed
    child_seconds: float | None = None


class BackgroundCompile:
    """One setup's background compile: capture, ship, agree, switch, clean up. It holds
    what the switch compiles (``module``'s regions by ``plan`` and ``recipe``;
    ``root_is_called`` as planned) and says when: ``at_step_boundary`` returns True, the
    strategy compiles them in place, then ``warm_evaluation``."""

    def __init__(
        self,
        module: nn.Module,
        root_is_called: bool,
        plan: RegionPlan,
        recipe: CompileRecipe,
        timeout_s: float,
        artifact_guard: dict[str, str],
    ) -> None:
        self.module = module
        self.root_is_called = root_is_called
        self.plan = plan
        self.recipe = recipe
        self.timeout_s = timeout_s
        self.artifact_guard = artifact_guard
        self.calls: dict[CallKey, RegionCall] = {}
        self.shipped: set[CallKey] = set()
        self._signatures: dict[tuple[int, CallKind], list[tuple[Any, ...]]] = {}
        self.unshipped: dict[int, str] = {}  # region index: why it cannot ship
        self.failure = ""
        self.child: Child | None = None
        #: What the child compiled or found in its rounds so far: cache artifacts and
        #: kernel files by path.
        self.artifacts: tuple[bytes, dict[str, bytes]] | None = None
        #: Every child this process started (one at most), kept after it stops: its
        #: rounds, threads and memory.
        self.children: list[Child] = []
        self.child_seconds: float | None = None
        self.outcome: Outcome | None = None  # set at the switch, on every process
        self.steps_eager = 0  # optimizer steps that ran before the switch
        self.switched_at: float | None = None  # seconds from setup to the switch
        #: Seconds from the switch to the end of the first compiled step
        #: (``first_compiled_step_done``): what the switch held training up for.
        self.stall_s: float | None = None
        self.created = time.perf_counter()
        #: torch's cache counters when the regions compiled in place (``compat.cache_counts``).
        self.counts_at_switch: dict[str, int] = {}
        self._threads_lent: IntraOpThreads | None = None  # threads before a child started
        self._order = itertools.count()
        self._hooks = [
            region.module.register_forward_pre_hook(self._recorder(index), with_kwargs=True)
            for index, region in enumerate(plan.regions)
        ]
        atexit.register(self.stop)  # Fabric has no teardown: at the latest, at exit

    # --- capture ------------------------------------------------------------------------

    def _recorder(self, index: int) -> Any:
        def record(module: nn.Module, args: Any, kwargs: Any) -> None:
            kind = CallKind.now(module)
            seen = self._signatures.setdefault((index, kind), [])
            if len(seen) >= SIGNATURES_PER_KIND or index in self.unshipped:
                return
            try:
                described = describe_call(args, kwargs)
            except Unshippable as error:
                self.unshipped[index] = str(error)
                return
            signature = call_signature(described)
            if signature not in seen:
                seen.append(signature)
                call = RegionCall(index, next(self._order), kind, described, len(seen))
                self.calls[(index, kind, len(seen))] = call

        return record

    # --- the step boundary --------------------------------------------------------------

    @property
    def switched(self) -> bool:
        """Whether the switch came (then the regions compile in place, warm)."""
        return self.outcome is not None

    def at_step_boundary(self, processes: Processes) -> bool:
        """After an optimizer step: ship or poll (rank 0) and agree; at the switch, share
        the outcome and stop the child. True when the switch came now: compile the
        regions in place now, then ``warm_evaluation``."""
        if self.switched:
            return False
        self.steps_eager += 1
        ready = self._advance() if processes.is_global_zero else True
        if not processes.reduce_boolean_decision(ready, all=True):
            self._share_cores()  # rank 0's child compiles: every rank lends threads
            return False
        outcome = self._outcome(processes) if processes.is_global_zero else None
        self.outcome = outcome = processes.broadcast(outcome, src=0)
        assert outcome is not None
        if not processes.is_global_zero:
            for artifacts in outcome.artifacts:
                if not unpack_artifacts(artifacts, self.artifact_guard, source=SOURCE):
                    break  # refused: one warning, and this process compiles cold
        self.child_seconds = outcome.child_seconds
        self.switched_at = time.perf_counter() - self.created
        self.counts_at_switch = cache_counts()
        self.stop()
        self._warn(outcome)
        return True

    def first_compiled_step_done(self) -> None:
        """The first step after the switch ended: the stall is known."""
        if self.switched_at is not None and self.stall_s is None:
            self.stall_s = time.perf_counter() - self.created - self.switched_at

    def warm_evaluation(self) -> None:
        """Replay each recorded evaluation call (made tensors, in the recorded order) on
        its compiled region, so that the first validation after the switch runs at warm
        speed: their graphs load now, inside the switch step, as the child's replay did.
        The random number generators are left as they were."""
        calls = sorted(
            (call for call in self.calls.values() if not call.kind.trains),
            key=lambda call: call.order,
        )
        cuda = sorted({torch.device(c.device).index or 0 for c in calls if "cuda" in c.device})
        with torch.random.fork_rng(devices=cuda):
            for call in calls:
                region = self.plan.regions[call.index].module
                args, kwargs = call.made()
                with call.kind.entered(region):
                    region(*args, **kwargs)

    def _advance(self) -> bool:
        """Rank 0: poll the child; ship what waits. True when nothing is left to do."""
        child = self.child
        if child is not None and not child.reported:
            if child.busy:
                if time.perf_counter() - child.started <= self.timeout_s:
                    return False
                self.failure = f"still compiling after background_timeout_s={self.timeout_s:g}"
                return True
            done = child.result()
            if "peak_rss_mb" in done:
                child.peak_rss_mb = max(float(done["peak_rss_mb"]), child.peak_rss_mb or 0.0)
            child.threads = done.get("threads", child.threads)
            if not done.get("ok"):
                self.failure = str(done.get("error"))
                return True
            self.child_seconds = (self.child_seconds or 0.0) + float(done.get("seconds", 0.0))
            self.artifacts = child.artifacts() or self.artifacts
        if self.failure:
            return True
        if all(key in self.shipped for key in self.calls):
            return True
        return not self._ship()

    def shipment(self) -> Shipment | None:
        """What a round ships now: the regions that can cross to another process (their
        structure on ``meta``), every call recorded for them, and the recipe; None when
        no call can ship. The regions that cannot are noted in ``unshipped``."""
        ours = {hook.id for hook in self._hooks}  # our recorders never cross
        copies, refused = shippable_copies([r.module for r in self.plan.regions], ours)
        self.unshipped.update(refused)
        place = {index: place for place, index in enumerate(copies)}  # in the shipment
        calls = [
            dataclasses.replace(call, index=place[key[0]])
            for key, call in self.calls.items()
            if key[0] in place
        ]
        if not calls:
            return None
        return Shipment(list(copies.values()), calls, self.recipe, self._all_threads())

    def _ship(self) -> bool:
        """Give the child (started now if none runs) a round of every call recorded so
        far, or note why not; True when a round was shipped. Those an earlier round
        compiled are replayed again, warm, so that dynamo's state (a shape that changed
        since the first call) is the training process's when the new ones compile."""
        self.shipped.update(self.calls)
        shipment = self.shipment()
        if shipment is None:
            return False
        try:
            payload = pack(shipment)
        except Unshippable as error:
            self.failure = str(error)
            return False
        if self.child is None:
            self.child = Child.start(payload, threads=lent_threads(self._all_threads()))
            self.children.append(self.child)
        else:
            self.child.ship(payload)
        self._share_cores()
        return True

    def _all_threads(self) -> int:
        """This process's intra-op threads when no child compiles: the count its compiled
        kernels are made for, and that inductor's cache key holds."""
        lent = self._threads_lent
        return torch.get_num_threads() if lent is None else lent.count

    def _share_cores(self) -> None:
        """While the job's child compiles, this process runs its eager steps on half its
        intra-op threads (at least one): with all of them, each parallel op of an eager
        step waits for a thread that the child's compile holds off its core
        (``benchmarks/results/background_compile.md``, before and after). Every process
        of the job does so until the switch: the steps go in lockstep at the pace of
        rank 0, whose eager steps share its cores with the child, and a rank beside the
        child on one node would take its cores too (``multi_node.md``). The child's
        parallel work runs on the other half (``lent_threads``). Not through
        ``torch.set_num_threads``, which would leave MKL's dynamic thread adjustment off
        and the steps after the switch slower (``threads.limit_intra_op_threads``)."""
        if self._threads_lent is None:
            self._threads_lent = limit_intra_op_threads(kept_threads(torch.get_num_threads()))

    def _end_child(self) -> None:
        """Stop the child, if any, and give this process its threads back."""
        if self.child is not None:
            self.child.stop()
            self.child = None
        if self._threads_lent is not None:
            restore_intra_op_threads(self._threads_lent)
            self._threads_lent = None

    def _outcome(self, processes: Processes) -> Outcome:
        unshipped = tuple(
            f"{self.plan.regions[index].label}: {why}" for index, why in self.unshipped.items()
        )
        artifacts: tuple[dict[str, Any], ...] = ()
        if not self.failure and _several(processes) and self.artifacts is not None:
            artifacts = (sign_artifacts(self.artifact_guard, *self.artifacts),)
        return Outcome(self.failure, unshipped, artifacts, self.child_seconds)

    def _warn(self, outcome: Outcome) -> None:
        if outcome.failure:
            warnings.warn(
                f"Background compile did not finish: {outcome.failure}. The regions compile "
                f"in the training process now, after {self.steps_eager} eager step(s), as "
                "in the default mode.",
                BackgroundCompileWarning,
                stacklevel=4,
            )
        elif outcome.unshipped:
            warnings.warn(
                "Background compile could not ship "
                f"{len(outcome.unshipped)} region(s): {'; '.join(outcome.unshipped)}. "
                f"They compile in the training process now, after {self.steps_eager} eager "
                "step(s); the others compiled in the background.",
                BackgroundCompileWarning,
                stacklevel=4,
            )

    # --- what happened -----------------------------------------------------------------

    def state(self) -> str:
        """A few words for the progress bar: what the child does, or where the switch
        came and whether the child failed."""
        if self.switched:
            outcome = self.outcome or Outcome()
            step = self.steps_eager + 1
            if outcome.failure:
                return f"background compile failed, compiled here at step {step}"
            return f"compiled in the background, switched at step {step}"
        if self.failure:
            return "background compile failed: compiling here at the switch"
        child = self.child
        if child is None or child.reported:
            return "compiling in the background: waiting for calls"
        seconds = f"{time.perf_counter() - child.started:.0f} s"
        progress = child.progress()
        if progress is None:
            return f"compiling in the background: {seconds}"
        return f"compiling in the background: {progress[0]} of {progress[1]} calls, {seconds}"

    def summary(self) -> str:
        """One line: when the switch came, after how many eager steps, and what torch's
        caches gave since (call it after the first compiled step)."""
        if not self.switched:
            return (
                f"regional compile: the run ended before the background compile switched; "
                f"{self.steps_eager} step(s) ran eager"
            )
        outcome = self.outcome or Outcome()
        if outcome.failure:
            how = f"the child failed ({outcome.failure}), so they compiled in this process"
        elif self.child_seconds is None:
            how = "no region could be shipped, so they compiled in this process"
        else:
            how = f"the child compiled for {self.child_seconds:.1f}s"
            if outcome.unshipped:
                how += f"; {len(outcome.unshipped)} region(s) that could not ship compiled here"
        now = cache_counts()
        since = {name: now[name] - self.counts_at_switch.get(name, 0) for name in now}
        counts = ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in since.items() if n)
        return (
            f"regional compile: background switch at step {self.steps_eager + 1} "
            f"({self.switched_at or 0.0:.1f}s after setup) after {self.steps_eager} eager "
            f"step(s); {how}" + (f"; torch's caches at the switch: {counts}" if counts else "")
        )

    def stop(self) -> None:
        """End the child, if any, and remove the hooks and the folder."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._end_child()
        atexit.unregister(self.stop)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running child, if any."""
        return None if self.child is None else self.child.process


def _several(processes: Processes) -> bool:
    return int(getattr(processes, "world_size", 1)) > 1
