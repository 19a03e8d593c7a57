"""The first-step reporter (``strategies/first_step.py``) on a real Trainer: the plan at
setup, the summary after the first optimizer step, regions never called said as an info
line, not a warning."""

from __future__ import annotations

import logging
import warnings

from helpers import SMALL, data, gpt, trainer
from torch import nn

from examples.lightning_gpt import GPTModule
from lightning_regions import RegionalCompileStrategy, RegionNotCompiledWarning


def test_report_is_logged_at_setup_and_after_the_first_step(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer(tmp_path, RegionalCompileStrategy(backend="eager"), steps=2).fit(gpt(), data())
    text = caplog.text
    assert "regional compile: 2 region(s)" in text
    assert "model.blocks.0, model.blocks.2, model.layers.0, model.layers.2" in text
    assert "aliases kept: model.blocks = model.layers; model.blocks.0 = model.blocks.2" in text
    assert "tied parameters kept: model.wte.weight = model.lm_head.weight" in text
    assert "after first step: 1 graph(s) compiled" in text
    assert "0 region(s) called without a compiled call" in text


class WithUnusedBlocks(GPTModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unused = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_regions_never_called_are_an_info_line_after_the_first_step_not_a_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    model = WithUnusedBlocks(vocab_size=data().vocab_size, **SMALL)
    strategy = RegionalCompileStrategy(backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionNotCompiledWarning)
        trainer(tmp_path, strategy, steps=2).fit(model, data())
    assert "2 region(s) not called in the first step" in caplog.text and "unused.0-1" in caplog.text
