"""``compile_in_background=True``: training starts eager while one child process compiles
the regions, and switches to them at a step boundary; classes defined in a function ship
by value; what cannot be shipped, a child that fails and one past its limit warn once and
leave training running (shown in the progress bar as well as warned); no child outlives
the Trainer, an exception in ``fit`` included;
``validate`` and ``predict`` alone compile at their start. Real Trainer, real child
processes, losses compared with plain Lightning (the real inductor backend:
``test_background_inductor.py``; 2-process DDP: ``test_ddp.py``)."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    FIGURES,
    WaitForTheSwitch,
    csv_figures,
    data,
    gpt,
    is_running,
    one_intra_op_thread,
    seeded_stack,
    terminal,
    trainer,
    vectors,
)
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from process_state import mkl_dynamic_adjustment, set_mkl_dynamic_adjustment
from torch import nn

from lightning_regions import (
    RegionalCompileFSDPStrategy,
    RegionalCompileStrategy,
    region_report,
)
from lightning_regions.background.switch import BackgroundCompileWarning, lent_threads

#: The most steps a run that waits for the switch may take; it stops 3 steps after it.
STEPS = 1000


def fit_both(
    tmp_path, ours_model, plain_model, trainer_options=None, **options
) -> RegionalCompileStrategy:
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True, **options)
    wait = WaitForTheSwitch(after=3)
    threads, mkl_dynamic = torch.get_num_threads(), mkl_dynamic_adjustment()
    extra = dict(trainer_options or {})
    callbacks = [wait, *extra.pop("callbacks", [])]
    run = trainer(tmp_path, strategy, STEPS, callbacks=callbacks, **extra)
    run.fit(ours_model, data())
    # lent and given back without torch.set_num_threads, which turns MKL's dynamic
    # adjustment off (threads.limit_intra_op_threads)
    assert mkl_dynamic_adjustment() == mkl_dynamic
    trainer(tmp_path, "auto", len(ours_model.losses)).fit(plain_model, data())
    assert ours_model.losses == pytest.approx(plain_model.losses, rel=1e-5)
    assert wait.pids and not any(map(is_running, wait.pids))  # no child outlives the Trainer
    # half the intra-op threads while a child compiles beside the eager steps, then all
    assert wait.threads == {"before the switch": {max(1, threads // 2)}, "after": {threads}}
    assert torch.get_num_threads() == threads
    # the child: its parallel work on the threads lent, its kernels made for all of the
    # training process's threads (inductor's cache key holds the count)
    assert wait.child_environment["OMP_THREAD_LIMIT"] == str(lent_threads(threads))
    assert strategy.background.children[-1].threads == threads
    assert strategy.background.process is None
    return strategy


def twins(build=gpt):
    ours, plain = build(), build()
    plain.load_state_dict(ours.state_dict())
    return ours, plain


def test_training_starts_eager_and_switches_to_the_compiled_regions(tmp_path):
    """Also: Lightning's tqdm bar (in a pseudo-terminal) shows the child's state until the
    switch, then the step it came at; the CSVLogger holds the switch's figures."""
    ours, plain = twins()
    with terminal() as term:
        options = {"enable_progress_bar": True, "callbacks": [TQDMProgressBar()]}
        options["logger"] = CSVLogger(tmp_path)
        strategy = fit_both(tmp_path, ours, plain, options)
    background = strategy.background
    shown = term.text
    switch = f"compiled in the background, switched at step {background.steps_eager + 1}"
    assert "· compiling in the background: " in shown and switch in shown
    assert shown.index("· compiling in the background: ") < shown.index(switch)
    figures = {name.removeprefix(FIGURES): v for name, v in csv_figures(tmp_path).items()}
    assert figures["background_switch_step"] == [background.steps_eager + 1]
    assert figures["background_failed"] == [0.0] and figures["background_stall_s"][0] > 0
    assert background.switched and not background.failure and background.child_seconds
    assert (background.children[-1].peak_rss_mb or 0) > 0
    assert 1 <= background.steps_eager == len(ours.losses) - 3
    report = region_report(ours)
    assert not report.ran_eager and all(row.compiled_calls for row in report.rows)
    assert ours.model.blocks[0]._compiled_call_impl is not None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_the_training_process_keeps_mkls_dynamic_thread_adjustment(tmp_path):
    """A process that never called ``torch.set_num_threads`` has MKL's dynamic adjustment
    on; lending the child a core and taking it back leaves it on (through
    ``torch.set_num_threads``, the steps after the switch ran slower for the rest of the
    run: ``benchmarks/results/mkl_dynamic.md``)."""
    was = mkl_dynamic_adjustment()
    set_mkl_dynamic_adjustment(True)
    try:
        strategy = fit_both(tmp_path, *twins())
        assert strategy.background.switched and mkl_dynamic_adjustment() is True
    finally:
        set_mkl_dynamic_adjustment(bool(was))


def test_the_child_compiles_for_the_training_processs_own_thread_count(tmp_path):
    """One intra-op thread in the training process (as a user's ``set_num_threads(1)``
    gives; set here through ``compat`` to keep the worker's MKL flag), where a new process
    would take one per core: the child compiles for one."""
    with one_intra_op_thread():  # not torch.set_num_threads: its MKL flag would stay off
        strategy = fit_both(tmp_path, *twins())
    assert strategy.background.children[-1].threads == 1 and strategy.background.switched


def test_the_child_reports_its_own_peak_memory_not_its_parents():
    """``ru_maxrss`` of a spawned child starts at its parent's peak (``exec`` carries it
    over); ``peak_rss_mb`` is the child's own."""
    import subprocess
    import sys

    from lightning_regions.background.child import peak_rss_mb

    held = torch.ones(256 * 2**20 // 4 * 4)  # 1 GiB, written: resident in this process
    parent = peak_rss_mb()
    code = "import resource; from lightning_regions.background.child import peak_rss_mb; "
    code += "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, inherited = map(float, done.stdout.split())
    del held
    assert inherited >= parent - 64  # what a child's getrusage says: the parent's peak
    assert own < parent - 512  # its own: torch imported, not the parent's GiB


def test_the_child_starts_without_lightning_and_the_package_is_whole_when_asked():
    """``entry.py`` imports the child without the package's ``__init__`` (so without
    Lightning); a top-level name asked of the package later runs that ``__init__``."""
    import subprocess
    import sys

    from lightning_regions.background import entry

    code = (
        "import sys; import lightning_regions.background.child; "
        "print('lightning' in sys.modules); "
        "from lightning_regions import TiedWeightsCheck, compile_regions; "
        "print('lightning' in sys.modules, TiedWeightsCheck.__module__)"
    )
    bootstrap = (
        f"import sys; sys.path.insert(0, {os.path.dirname(entry.__file__)!r}); import entry; "
        "del sys.path[0]; sys.modules['lightning_regions'] = entry.package_without_init(); "
    )
    done = subprocess.run(
        [sys.executable, "-c", bootstrap + code], capture_output=True, text=True, check=True
    )
    before, after = done.stdout.splitlines()
    assert before == "False"  # the child's own imports: torch and the core, no Lightning
    assert after == "True lightning_regions.diagnosis.tiecheck"


def test_classes_defined_in_a_function_ship_by_value(tmp_path):
    class LocalBlock(nn.Module):  # no other process can import it: it travels by value
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(x).tanh()

    ours, plain = (seeded_stack(lambda: [LocalBlock() for _ in range(3)]) for _ in range(2))
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    wait = WaitForTheSwitch(after=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackgroundCompileWarning)
        trainer(tmp_path, strategy, STEPS, callbacks=[wait]).fit(ours, vectors())
    trainer(tmp_path, "auto", len(ours.losses)).fit(plain, vectors())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    background = strategy.background
    assert background.switched and background.outcome.failure == "" and len(wait.pids) == 1
    assert background.child_seconds is not None and not region_report(ours).ran_eager


class LockedBlock(nn.Module):
    """A block holding a lock: no pickler can copy it to another process."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x).tanh()


def test_a_region_that_cannot_be_shipped_warns_once_and_compiles_in_process(tmp_path):
    ours, plain = (seeded_stack(lambda: [LockedBlock() for _ in range(3)]) for _ in range(2))
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    with pytest.warns(BackgroundCompileWarning, match="cannot pickle '_thread.lock'") as caught:
        trainer(tmp_path, strategy, 6).fit(ours, vectors())
    warned = [w for w in caught if issubclass(w.category, BackgroundCompileWarning)]
    assert len(warned) == 1 and "LockedBlock at blocks.0" in str(warned[0].message)
    trainer(tmp_path, "auto", 6).fit(plain, vectors())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert strategy.background.steps_eager == 1  # switched at the first step boundary
    assert strategy.background.children == []  # nothing to ship: no child
    assert not region_report(ours).ran_eager


class FailsElsewhere(nn.Module):
    """A block that loads only in the process that built it: the child fails."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.home = os.getpid()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if os.getpid() != self.home:
            raise RuntimeError("this block runs only where it was built")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x).tanh()


def test_a_failed_background_compile_warns_once_and_training_goes_on(tmp_path):
    ours, plain = (seeded_stack(lambda: [FailsElsewhere() for _ in range(3)]) for _ in range(2))
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    wait = WaitForTheSwitch(after=3)
    with (
        terminal() as term,
        pytest.warns(BackgroundCompileWarning, match="runs only where it was built") as caught,
    ):
        callbacks = [wait, RichProgressBar()]
        run = trainer(tmp_path, strategy, STEPS, callbacks=callbacks, enable_progress_bar=True)
        run.fit(ours, vectors())
    assert sum(issubclass(w.category, BackgroundCompileWarning) for w in caught) == 1
    # shown as well as warned, in Lightning's Rich bar
    step = strategy.background.steps_eager + 1
    assert f"background compile failed, compiled here at step {step}" in term.text
    trainer(tmp_path, "auto", len(ours.losses)).fit(plain, vectors())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert strategy.background.switched and strategy.background.process is None
    assert wait.pids and not any(map(is_running, wait.pids))
    assert not region_report(ours).ran_eager  # compiled in the training process instead


def test_a_background_compile_past_its_limit_is_stopped_with_one_warning(tmp_path):
    ours, plain = twins()
    strategy = RegionalCompileStrategy(
        backend="aot_eager", compile_in_background=True, background_timeout_s=0.01
    )
    wait = WaitForTheSwitch()
    with pytest.warns(BackgroundCompileWarning, match="background_timeout_s=0.01") as caught:
        trainer(tmp_path, strategy, 8, callbacks=[wait]).fit(ours, data())
    assert sum(issubclass(w.category, BackgroundCompileWarning) for w in caught) == 1
    trainer(tmp_path, "auto", 8).fit(plain, data())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert wait.pids and not any(map(is_running, wait.pids))
    assert strategy.background.steps_eager == 2  # shipped after step 1, stopped after step 2


class Interrupt(pl.Callback):
    def __init__(self) -> None:
        self.pids: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        process = trainer.strategy.background.process
        if process is not None:
            self.pids.append(process.pid)
            raise RuntimeError("the user's code fails mid-run")


def test_an_exception_in_fit_leaves_no_child_running(tmp_path):
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    interrupt = Interrupt()
    with pytest.raises(RuntimeError, match="fails mid-run"):
        trainer(tmp_path, strategy, 20, callbacks=[interrupt]).fit(gpt(), data())
    assert interrupt.pids and not is_running(interrupt.pids[0])
    assert strategy.background.process is None


def test_fsdp2_and_nested_refuse_the_mode_at_once_with_the_reason():
    with pytest.raises(ValueError, match="not supported under FSDP2"):
        RegionalCompileFSDPStrategy(compile_in_background=True)
    with pytest.raises(ValueError, match="granularity='nested'"):
        RegionalCompileStrategy(compile_in_background=True, granularity="nested")
    with pytest.raises(ValueError, match="background_timeout_s=0"):
        RegionalCompileStrategy(compile_in_background=True, background_timeout_s=0)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x).tanh()


def fabric_losses(strategy, until_switched: bool) -> tuple[list[float], nn.Module]:
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    model = nn.Sequential(*(Residual() for _ in range(4)))
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    losses: list[float] = []
    while len(losses) < 200:
        loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        background = getattr(fabric.strategy, "background", None)
        if background is not None and not background.switched:
            time.sleep(0.1)
        elif until_switched and len(losses) >= background.steps_eager + 3:
            break  # three compiled steps after the switch
    return losses, model


def test_a_fabric_loop_switches_too_with_plain_losses():
    import lightning_regions.fabric as fabric

    strategy = fabric.RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    ours, model = fabric_losses(strategy, until_switched=True)
    assert strategy.background.switched and not strategy.background.failure
    plain, _ = fabric_losses("auto", until_switched=False)
    assert ours == pytest.approx(plain[: len(ours)], rel=1e-5)
    assert not region_report(model.module).ran_eager  # the module under Fabric's wrapper
    strategy.teardown()
    assert strategy.background.process is None


def test_a_smaller_last_batch_before_the_switch_is_the_same_childs_next_round(tmp_path):
    def epochs() -> torch.utils.data.DataLoader:  # batches of 4, 4 and 2 an epoch
        return torch.utils.data.DataLoader(torch.randn(10, 8, generator=torch.Generator()), 4)

    ours, plain = (seeded_stack(lambda: [Residual() for _ in range(3)]) for _ in range(2))
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    wait = WaitForTheSwitch(after=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackgroundCompileWarning)
        trainer(tmp_path, strategy, STEPS, callbacks=[wait], max_epochs=-1).fit(ours, epochs())
    background = strategy.background
    assert background.switched and background.steps_eager > 3  # the last batch came before
    assert {signature for *_, signature in background.shipped} == {1, 2}
    assert (
        len(wait.pids) == 1 and sum(child.round for child in background.children) == 2
    )  # both shapes, one child
    assert not any(map(is_running, wait.pids))
    trainer(tmp_path, "auto", len(ours.losses), max_epochs=-1).fit(plain, epochs())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)


def test_a_validation_after_the_first_step_ships_its_calls_too(tmp_path):
    ours, plain = twins()
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    wait = WaitForTheSwitch(after=3)
    options = {"validate": True, "num_sanity_val_steps": 0, "val_check_interval": 2}
    trainer(tmp_path, strategy, STEPS, [wait], **options).fit(ours, data())  # validate each 2 steps
    background = strategy.background
    kinds = {str(kind) for _, kind, _ in background.shipped}
    assert kinds == {"training", "evaluation"} and background.switched
    assert (
        len(wait.pids) == 1 and sum(child.round for child in background.children) >= 2
    )  # evaluation: the child's next round
    trainer(tmp_path, "auto", len(ours.losses), **options).fit(plain, data())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)


@pytest.mark.parametrize("entry", ["validate", "predict"])
def test_validate_and_predict_alone_compile_at_their_start(tmp_path, entry, caplog):
    caplog.set_level(logging.INFO)
    ours, plain = twins()
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    theirs = getattr(trainer(tmp_path, "auto", limit_val_batches=2, limit_predict_batches=2), entry)
    mine = getattr(trainer(tmp_path, strategy, limit_val_batches=2, limit_predict_batches=2), entry)
    got, expected = mine(ours, data()), theirs(plain, data())
    if entry == "predict":
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    else:
        assert got[0] == pytest.approx(expected[0], rel=1e-5)
    assert "this run has none (validate, test or predict): the regions compile now" in caplog.text
    report = region_report(ours)
    assert report.rows and all(row.compiled_calls for row in report.rows)
    assert strategy.background is None


class OneProcess:
    """The one process of a run on a single device, as a strategy answers for it."""

    is_global_zero = True

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def broadcast(self, obj: object, src: int = 0) -> object:
        return obj


def test_what_ships_is_structure_and_call_metadata_never_weights():
    from lightning_regions import find_regions
    from lightning_regions.background.child import shipment_file
    from lightning_regions.background.shipment import unpack
    from lightning_regions.background.switch import BackgroundCompile
    from lightning_regions.core.recipe import CompileRecipe
    from lightning_regions.options import RegionalOptions

    width = 256  # 4 blocks of 256 KB of weights each
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4))
    plan = find_regions(blocks)
    recipe = CompileRecipe(RegionalOptions(backend="aot_eager"))
    background = BackgroundCompile(blocks, True, plan, recipe, timeout_s=60, artifact_guard={})
    try:
        x = torch.randn(2, width)
        for block in blocks:
            x = block(x)  # the recorders see each region's training call
        assert not background.at_step_boundary(OneProcess())
        shipped = shipment_file(background.child.where, 1).read_bytes()
    finally:
        background.stop()
    weights = sum(p.numel() * p.element_size() for p in blocks.parameters())
    assert len(shipped) < weights / 20, (len(shipped), weights)
    shipment = unpack(shipped)
    tensors = [t for region in shipment.regions for t in region.state_dict().values()]
    assert len(tensors) == 8 and all(t.is_meta for t in tensors)
    assert len(shipment.calls) == 4 and {str(call.kind) for call in shipment.calls} == {"training"}
