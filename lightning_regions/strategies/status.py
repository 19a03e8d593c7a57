"""Lightning glue: a compile shown while it runs, in the progress bar in use or, without
one, in the log.

torch calls us when it begins and ends a compile (``TorchCallbacks``), on the thread
that compiles, which is busy inside dynamo until the end. So the start starts one helper
thread, which redraws the status every ``REFRESH_S`` from what the start recorded (what
compiles, ``core.progress``) and torch's event stack of the compiling thread, read as a
copy (``compat.compile_events``); the end stops it and puts the bar's own text back. No
thread runs and nothing is called while nothing compiles.

Where it draws (``surface_for``): Lightning's ``TQDMProgressBar`` or ``RichProgressBar``
(or a subclass) writing to a terminal or a notebook gets the status after its
description; otherwise (no bar, ``enable_progress_bar=False``, a bar of another kind, or
output to a file) rank zero logs one line at the start and one every ``HEARTBEAT_S``
while it goes on. The helper thread draws with each bar's own locking: tqdm's
``set_description_str`` redraws under tqdm's lock; Rich's ``Progress.update`` takes the
progress's lock and Rich's ``Progress.refresh`` redraws under the live display's, the
lock Rich's own refresh thread takes (Lightning's ``RichProgressBar.refresh`` is not
called: its signature differs between Lightning releases). The compiling thread touches
neither bar until the end, when the helper thread has stopped and been joined.

Between compiles, ``note`` keeps a few words after the bar's description (the
background compile's state, until its switch), redrawn at the step boundary that
changes them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only

from ..compat import compile_callbacks, compile_events, compiling_code
from ..core.progress import CompileProgress, RunningCompile, compile_phase
from ..core.regions import RegionPlan

#: How often the bar's status is redrawn while a compile runs, in seconds.
REFRESH_S = 1.0
#: How often a line says a compile still runs where no bar shows it, in seconds.
HEARTBEAT_S = 30.0
#: The parts of a graph compiled on their first call, by the name of the trigger torch
#: calls its compile callbacks with (``DYNAMO``, a frame, is no part).
COMPILE_PARTS = {"LAZY_BACKWARD": "backward", "CUDAGRAPH_RECORDING": "CUDA graphs"}
#: Between the bar's own description and the status.
SEPARATOR = " · "


class Surface(Protocol):
    """Where a compile's status is drawn."""

    def show(self, running: RunningCompile, now: float, phase: str) -> None: ...

    def restore(self) -> None: ...


class BarSurface:
    """A bar's description, with the status after it; the subclasses read and write it."""

    target: tuple[int, ...]  # which bar or task it draws, by identity

    def __init__(self) -> None:
        self.description = self.read()

    def read(self) -> str:
        raise NotImplementedError

    def write(self, description: str) -> None:
        raise NotImplementedError

    def show(self, running: RunningCompile, now: float, phase: str) -> None:
        self.write(after(self.description, running.text(now, phase)))

    def restore(self) -> None:
        self.write(self.description)


def after(description: str, text: str) -> str:
    """``text`` after a bar's ``description`` (tqdm's ends in ": ")."""
    return f"{description.rstrip().rstrip(':')}{SEPARATOR}{text}"


class TqdmSurface(BarSurface):
    """One of Lightning's tqdm bars (``set_description_str`` refreshes it)."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.target = bar, (id(bar),)
        super().__init__()

    def read(self) -> str:
        return str(self.bar.desc)

    def write(self, description: str) -> None:
        self.bar.set_description_str(description)


class RichSurface(BarSurface):
    """One task of Lightning's Rich progress (its refresh thread redraws it)."""

    def __init__(self, callback: RichProgressBar, task: Any) -> None:
        assert callback.progress is not None
        self.callback, self.progress, self.task = callback, callback.progress, task
        self.target = (id(callback), int(task))
        super().__init__()

    def read(self) -> str:
        return str(self.progress.tasks[self.task].description)

    def write(self, description: str) -> None:
        self.progress.update(self.task, description=description)
        self.progress.refresh()  # now: Rich's own thread would wait up to a second


class LogSurface:
    """Rank zero's log: a line at the start, then one every ``heartbeat_s``."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.last: float | None = None

    def show(self, running: RunningCompile, now: float, phase: str) -> None:
        if self.last is None:
            rank_zero_info(f"regional compile: {running.headline()}")
        elif now - self.last >= self.heartbeat_s:
            rank_zero_info(f"regional compile: {running.still(now)}")
        else:
            return
        self.last = now

    def restore(self) -> None:
        pass


#: Each stage's bar: tqdm's property, and Rich's task id attribute.
STAGE_BARS = {
    RunningStage.TRAINING: ("train_progress_bar", "train_progress_bar_id"),
    RunningStage.SANITY_CHECKING: ("val_progress_bar", "val_sanity_progress_bar_id"),
    RunningStage.VALIDATING: ("val_progress_bar", "val_progress_bar_id"),
    RunningStage.TESTING: ("test_progress_bar", "test_progress_bar_id"),
    RunningStage.PREDICTING: ("predict_progress_bar", "predict_progress_bar_id"),
}


def surface_for(trainer: Any, heartbeat_s: float) -> Surface:
    """The bar of ``trainer``'s running stage where it shows live, else the log."""
    return bar_for(trainer) or LogSurface(heartbeat_s)


def bar_for(trainer: Any) -> BarSurface | None:
    """The bar of ``trainer``'s running stage where it shows live, or None."""
    callback = getattr(trainer, "progress_bar_callback", None)
    bars = STAGE_BARS.get(trainer.state.stage) if trainer is not None else None
    if callback is None or bars is None or not callback.is_enabled:
        return None
    if isinstance(callback, TQDMProgressBar):
        try:
            bar = getattr(callback, bars[0])
        except TypeError:  # not made yet
            bar = None
        if bar is not None and not bar.disable and _live(bar):
            return TqdmSurface(bar)
    if isinstance(callback, RichProgressBar) and callback.progress is not None:
        task = getattr(callback, bars[1], None)
        console = callback.progress.console
        if task is not None and (console.is_terminal or console.is_jupyter):
            return RichSurface(callback, task)
    return None


def _live(bar: Any) -> bool:
    """Whether a tqdm bar draws live: in a terminal, or a notebook's widget."""
    if type(bar).__module__.startswith("tqdm.notebook"):
        return True
    isatty = getattr(bar.fp, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class StatusThread(threading.Thread):
    """Draws one compile's status until ``finish``, which puts the surface back."""

    NAME = "lightning_regions compile status"

    def __init__(self, running: RunningCompile, events: list[str], surface: Surface) -> None:
        super().__init__(name=self.NAME, daemon=True)
        self.running, self.events, self.surface = running, events, surface
        self.stopped = threading.Event()

    def draw(self) -> None:
        self.surface.show(self.running, time.perf_counter(), compile_phase(list(self.events)))

    def run(self) -> None:
        while not self.stopped.wait(REFRESH_S):
            try:
                self.draw()
            except Exception as error:  # a bar closed under it: the compile goes on
                rank_zero_debug(f"regional compile: the status stopped drawing: {error!r}")
                return

    def finish(self) -> None:
        self.stopped.set()
        self.join()
        self.surface.restore()


class TorchCallbacks:
    """Our two callbacks in torch's compile callbacks (``compat.compile_callbacks``),
    holding the status weakly: torch calls them on the thread that compiles, once for
    nested compiles, with the trigger (a frame, or ``COMPILE_PARTS``) and compile id."""

    @staticmethod
    def register(status: CompileStatus) -> tuple[Any, Any]:
        """Register both for ``status``; the two."""
        this = weakref.ref(status)

        def relay(method: str) -> Callable[[Any], None]:
            def call(args: Any) -> None:
                target = this()
                if target is None:
                    return
                name = args.callback_trigger.name
                part = "" if name == "DYNAMO" else COMPILE_PARTS.get(name, name.lower())
                try:
                    getattr(target, method)(part, args.compile_id)
                except Exception as error:  # showing a compile must never fail it
                    rank_zero_debug(f"regional compile: the status failed: {error!r}")

            return call

        started, ended = relay("started"), relay("ended")
        compile_callbacks.register_start_callback(started)
        compile_callbacks.register_end_callback(ended)
        return started, ended

    @staticmethod
    def held(started: Any, ended: Any) -> bool:
        return started in compile_callbacks.start_callbacks

    @staticmethod
    def remove(started: Any, ended: Any) -> None:
        for callbacks, callback in (
            (compile_callbacks.start_callbacks, started),
            (compile_callbacks.end_callbacks, ended),
        ):
            if callback in callbacks:  # torch._dynamo.reset() clears them all
                callbacks.remove(callback)


class CompileStatus:
    """Shows each compile of a setup while it runs (entered at the compile point, left at
    teardown): rank zero only. torch holds our callbacks through a weak reference, so a
    Fabric loop never torn down leaves none behind once its strategy is gone."""

    #: The one status that shows this process's compiles: the last entered (a Fabric
    #: loop is often never torn down, and a notebook may hold an earlier one).
    showing: ClassVar[weakref.ref[CompileStatus] | None] = None

    def __init__(self) -> None:
        self._progress: CompileProgress | None = None
        self._trainer: Callable[[], Any] = lambda: None
        self._drawing: StatusThread | None = None
        #: Removes our callbacks from torch's: at ``exit``, or when this is collected.
        self._callbacks: tuple[Any, Any] | None = None
        self._release: weakref.finalize | None = None
        #: The last note drawn: its bar, the description before it, and what was drawn.
        self._note: tuple[tuple[int, ...], str, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``torch.save`` or ``deepcopy`` of a model that reaches the strategy)
        shows nothing: the code objects, the callbacks and the thread stay here."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def enter(self, plan: RegionPlan, trainer: Callable[[], Any]) -> None:
        """Show the compiles of ``plan``'s regions (and any other) from now on;
        ``trainer`` gives the Trainer whose bar shows them (None: the log)."""
        if getattr(rank_zero_only, "rank", 0) != 0:
            return
        earlier = CompileStatus.showing() if CompileStatus.showing is not None else None
        if earlier is not None and earlier is not self:
            earlier.unregister()
        CompileStatus.showing = weakref.ref(self)
        if self._callbacks is None or not TorchCallbacks.held(*self._callbacks):
            self.unregister()  # or torch._dynamo.reset() took them: again
            self._callbacks = TorchCallbacks.register(self)
            self._release = weakref.finalize(self, TorchCallbacks.remove, *self._callbacks)
        self._progress, self._trainer = CompileProgress(plan), trainer

    def note(self, text: str) -> None:
        """Keep ``text`` after the description of the running stage's bar (replacing the
        last note), until the bar's own next description; nothing without a bar (the
        background compile's state between compiles: its lines are in the log)."""
        bar = bar_for(self._trainer()) if self._callbacks is not None else None
        if bar is None:
            return
        base = bar.description
        if self._note is not None and self._note[0] == bar.target and base == self._note[2]:
            base = self._note[1]
        written = after(base, text)
        try:
            bar.write(written)
        except Exception as error:  # showing the state must never fail the step
            rank_zero_debug(f"regional compile: the status failed: {error!r}")
            return
        self._note = (bar.target, base, written)

    def exit(self) -> None:
        self.ended("", "")
        self.unregister()

    def unregister(self) -> None:
        """Give our callbacks back to torch (``exit``, or a newer status entered)."""
        if self._release is not None:
            self._release()  # removes the callbacks, once
        self._callbacks = self._release = None
        self._progress = None

    def started(self, part: str, compile_id: str) -> None:
        """torch begins a compile (on the thread that compiles)."""
        if self._progress is None or self._drawing is not None:
            return
        code = None if part else compiling_code()
        running = self._progress.begin(code, compile_id, part, time.perf_counter())
        surface = surface_for(self._trainer(), HEARTBEAT_S)
        self._drawing = StatusThread(running, compile_events(), surface)
        self._drawing.draw()
        self._drawing.start()

    def ended(self, part: str, compile_id: str) -> None:
        """torch ended a compile: stop drawing, put the bar's text back."""
        drawing, self._drawing = self._drawing, None
        if drawing is not None:
            drawing.finish()
