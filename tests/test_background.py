"""``compile_in_background=True``: training starts eager while a child process compiles the
regions, and switches to them at a step boundary; what cannot be shipped, a child that
fails and one past its limit warn once and leave training running; no child outlives the
Trainer, an exception in ``fit`` included. Real Trainer, real child processes, losses
compared with plain Lightning (2-process DDP: ``test_ddp.py``)."""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import pytest
import torch
from helpers import WaitForTheSwitch, data, gpt, seeded_stack, trainer, vectors
from torch import nn

from lightning_regions import (
    RegionalCompileFSDPStrategy,
    RegionalCompileStrategy,
    region_report,
)
from lightning_regions.background import BackgroundCompileWarning

STEPS = 120


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fit_both(tmp_path, ours_model, plain_model, **options) -> RegionalCompileStrategy:
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True, **options)
    wait = WaitForTheSwitch()
    trainer(tmp_path, strategy, STEPS, callbacks=[wait]).fit(ours_model, data())
    trainer(tmp_path, "auto", STEPS).fit(plain_model, data())
    assert ours_model.losses == pytest.approx(plain_model.losses, rel=1e-5)
    assert not any(is_running(pid) for pid in wait.pids)  # no child outlives the Trainer
    assert strategy.background.process is None and strategy.background.folder is None
    return strategy


def twins(build=gpt):
    ours, plain = build(), build()
    plain.load_state_dict(ours.state_dict())
    return ours, plain


def test_training_starts_eager_and_switches_to_the_compiled_regions(tmp_path):
    ours, plain = twins()
    strategy = fit_both(tmp_path, ours, plain)
    background = strategy.background
    assert background.switched and not background.failure and background.child_seconds
    assert 1 <= background.steps_eager < STEPS
    report = region_report(ours)
    assert not report.ran_eager and all(row.compiled_calls for row in report.rows)
    assert ours.model.blocks[0]._compiled_call_impl is not None


def test_a_region_that_cannot_be_shipped_warns_once_and_compiles_in_process(tmp_path):
    class LocalBlock(nn.Module):  # defined in a function: no other process can import it
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(x).tanh()

    loader = vectors()
    ours, plain = (seeded_stack(lambda: [LocalBlock() for _ in range(3)]) for _ in range(2))
    strategy = RegionalCompileStrategy(backend="aot_eager", compile_in_background=True)
    with pytest.warns(BackgroundCompileWarning, match="LocalBlock is defined in") as caught:
        trainer(tmp_path, strategy, 6).fit(ours, loader)
    assert sum(issubclass(w.category, BackgroundCompileWarning) for w in caught) == 1
    trainer(tmp_path, "auto", 6).fit(plain, loader)
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert strategy.background.steps_eager == 1  # switched at the first step boundary
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
    wait = WaitForTheSwitch()
    with pytest.warns(BackgroundCompileWarning, match="runs only where it was built") as caught:
        trainer(tmp_path, strategy, STEPS, callbacks=[wait]).fit(ours, vectors())
    assert sum(issubclass(w.category, BackgroundCompileWarning) for w in caught) == 1
    trainer(tmp_path, "auto", STEPS).fit(plain, vectors())
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert strategy.background.switched and strategy.background.process is None
    assert wait.pids and not any(is_running(pid) for pid in wait.pids)
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
    assert wait.pids and not any(is_running(pid) for pid in wait.pids)
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
    assert strategy.background.process is None and strategy.background.folder is None


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
