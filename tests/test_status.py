"""A compile shown while it runs (``strategies/status.py``): in Lightning's tqdm and Rich
bars (a user's subclass of each) in a pseudo-terminal, redrawn at least every 2 s and
gone after it; without a bar, a line at its start and a heartbeat, for the Trainer and
a Fabric loop; no thread and no torch callback of ours left outside a compile or after
teardown. Real Trainer and Fabric, real compiles made slow by a backend that sleeps when
dynamo calls it (``helpers.SlowToCompile``). The background mode's state in the bar:
``test_background.py``."""

from __future__ import annotations

import gc
import itertools
import logging
import re
import threading

import pytest
import torch
from helpers import SlowToCompile, data, gpt, terminal, trainer
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch import nn
from torch.utils.data import DataLoader

import lightning_regions.fabric as regional_fabric
from examples.fabric_gpt import train
from lightning_regions import RegionalCompileStrategy
from lightning_regions.core.regions import find_regions
from lightning_regions.strategies import status

#: How long dynamo's call of the backend sleeps: the compile the status shows.
COMPILE_S = 4.0
#: The status of the tiny GPT's one block class compiling, with its seconds.
SHOWN = re.compile(r"compiling GPTBlock \(1 of 1\): (\d+) s")


class OwnTqdmBar(TQDMProgressBar):
    """A user's own bar: Lightning's tqdm bar with its own description."""

    def init_train_tqdm(self):
        bar = super().init_train_tqdm()
        bar.set_description_str("mine")
        return bar


class OwnRichBar(RichProgressBar):
    """A user's own Rich bar, another description."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"mine {current_epoch}"


def status_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == status.StatusThread.NAME]


def ours_registered() -> bool:
    handler = torch._dynamo.callback_handler
    return any(
        "lightning_regions" in getattr(callback, "__module__", "")
        for callback in (*handler.start_callbacks, *handler.end_callbacks)
    )


def assert_redrawn(shown: list[int], seconds: float) -> None:
    """The seconds drawn go 0, 1, 2... at most 2 apart up to the compile's length."""
    assert shown and shown[0] == 0 and shown[-1] >= seconds - 1, shown
    assert all(later - earlier <= 2 for earlier, later in itertools.pairwise(shown)), shown


def assert_shown_while_compiling_and_gone_after(text: str, description: str) -> None:
    """Redrawn through the compile; the last drawing of the bar holds its own
    description and no status."""
    assert_redrawn(sorted({int(seconds) for seconds in SHOWN.findall(text)}), COMPILE_S)
    last = text.rsplit(description, 1)[1]
    assert "compiling" not in last.split("\r")[0].split("\n")[0], last[:200]


@pytest.mark.parametrize("bar", [OwnTqdmBar, OwnRichBar])
def test_the_bar_shows_what_compiles_and_for_how_long_then_its_own_text(tmp_path, bar):
    strategy = RegionalCompileStrategy(backend=SlowToCompile(COMPILE_S))
    with terminal() as term:
        callback = bar()
        run = trainer(tmp_path, strategy, 3, callbacks=[callback], enable_progress_bar=True)
        run.fit(gpt(), data())
    text = term.text
    assert_shown_while_compiling_and_gone_after(text, "mine")
    assert "compiling GPTBlock's backward (1 of 1)" in text
    assert "· compiling GPTBlock (1 of 1): 1 s, backend" in text  # torch's phase: our sleep
    assert status_threads() == [] and not ours_registered()


def batches(lengths: list[int]) -> DataLoader:
    """One batch of 4 character sequences for each length: a length new to dynamo makes
    it compile the blocks again."""
    tokens = data().tokens
    chunks = [(tokens[: 4 * n].view(4, n), tokens[1 : 4 * n + 1].view(4, n)) for n in lengths]
    return DataLoader(chunks, batch_size=None)


def seconds_shown(text: str, pattern: str) -> list[int]:
    """The seconds of each drawing of ``pattern``'s status, one per redraw."""
    return sorted({int(seconds) for seconds in re.findall(pattern + r": (\d+) s", text)})


def test_a_validations_compile_and_a_later_recompile_show_in_their_own_bars(tmp_path):
    """Validation's first call of the blocks (no grad: dynamo compiles them again) shows in
    Lightning's validation bar, and a fourth training step of a new length in the training
    bar, each redrawn every second or two, and gone after. The keep-or-revert gate is off:
    it would time that step on eager."""
    seconds = 3.0
    strategy = RegionalCompileStrategy(backend=SlowToCompile(seconds), keep_if_faster=False)
    with terminal() as term:
        run = trainer(
            tmp_path,
            strategy,
            4,
            callbacks=[TQDMProgressBar()],
            enable_progress_bar=True,
            limit_val_batches=1,
            val_check_interval=2,
            num_sanity_val_steps=0,
        )
        run.fit(gpt(), batches([16, 16, 16, 12]), batches([16]))
    text = term.text
    for bar in ("Validation", "Epoch 0"):
        assert_redrawn(seconds_shown(text, bar + r"[^\r\n]* · recompiling GPTBlock"), seconds)
    last_train = text.rsplit("Epoch 0", 1)[1].split("\r")[0]
    assert "compiling" not in last_train, last_train
    assert status_threads() == [] and not ours_registered()


def test_without_a_bar_a_line_at_the_start_then_a_heartbeat(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(status, "HEARTBEAT_S", 1.0)
    strategy = RegionalCompileStrategy(backend=SlowToCompile(COMPILE_S))
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, strategy, 2).fit(gpt(), data())  # enable_progress_bar=False
    lines = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert lines[0] == "regional compile: compiling GPTBlock (1 of 1)", lines
    still = [line for line in lines if "still compiling GPTBlock: " in line]
    assert len(still) >= COMPILE_S - 2 and still[0].endswith(" s, 1 of 1"), lines
    assert status_threads() == [] and not ours_registered()


def test_a_fabric_loop_gets_the_same_lines(caplog, monkeypatch):
    monkeypatch.setattr(status, "HEARTBEAT_S", 1.0)
    strategy = regional_fabric.RegionalCompileStrategy(backend=SlowToCompile(COMPILE_S / 2))
    with caplog.at_level(logging.INFO):
        train(Fabric(accelerator="cpu", devices=1, strategy=strategy), steps=2)
    text = caplog.text
    assert "regional compile: compiling GPTBlock (1 of 1)" in text
    assert "regional compile: still compiling GPTBlock: 1 s, 1 of 1" in text
    assert status_threads() == []
    strategy.teardown()
    assert not ours_registered()


def test_a_status_never_left_takes_its_callbacks_along_and_one_reset_took_is_registered_again():
    """A Fabric loop is often never torn down: torch holds our callbacks weakly. And
    ``torch._dynamo.reset()`` clears torch's compile callbacks: the next setup registers
    them again."""
    plan = find_regions(nn.Sequential(nn.Linear(2, 2)), ["0"])
    shown = status.CompileStatus()
    shown.enter(plan, lambda: None)
    assert ours_registered()
    torch._dynamo.reset()
    assert not ours_registered()
    shown.enter(plan, lambda: None)
    assert ours_registered()
    del shown
    gc.collect()
    assert not ours_registered()


def test_one_status_a_process_and_a_failing_one_never_fails_the_compile():
    """The last status entered shows the process's compiles (an earlier one never torn
    down gives its callbacks up); one whose drawing raises leaves the compile be."""
    plan = find_regions(nn.Sequential(nn.Linear(2, 2)), ["0"])
    first, second = status.CompileStatus(), status.CompileStatus()
    first.enter(plan, lambda: None)
    second.enter(plan, lambda: 1 / 0)  # no Trainer to read: its surface raises
    handler = torch._dynamo.callback_handler
    ours = [c for c in handler.start_callbacks if "lightning_regions" in c.__module__]
    assert len(ours) == 1
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(3)), torch.ones(3).sin() + 1)
    assert status_threads() == []
    second.exit()
    assert not ours_registered()
