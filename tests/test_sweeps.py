"""What the process's torch.compile state does to a model, named right.

Sweeps and reruns in one process: a model of the same block classes at another width
each time (Optuna's trials, a notebook's cells). dynamo keeps every graph it compiled for
a code object, and counts them against ``recompile_limit`` (8) for every later model of
the class: the fifth width of a block compiled two ways (block 0's input needs no grad,
the others' do) ran eager, with warnings that blamed per-instance guards. And torch.compile
turned off in the process (``TORCH_COMPILE_DISABLE=1``), which was blamed the same way."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from helpers import BlockStack, trainer
from torch import nn

from lightning_regions import (
    PerInstanceRecompileWarning,
    RegionalCompileStrategy,
    RegionNotCompiledWarning,
    region_report,
)
from lightning_regions.compat import graphs_held, recompile_limit

WIDTHS = (8, 16, 24, 32, 40, 48)


class SweptBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Swept(BlockStack):
    """Four blocks of one width, trained on the first ``width`` columns of the data."""

    def __init__(self, width: int) -> None:
        torch.manual_seed(width)
        super().__init__([SweptBlock(width) for _ in range(4)], width=None, lr=1e-2)
        self.width = width

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[:, : self.width], batch_idx)


def trial(tmp_path, width: int) -> tuple[Swept, list[warnings.WarningMessage]]:
    """One trial: its model fitted 2 steps under the strategy, and the warnings given."""
    model = Swept(width)
    data = torch.utils.data.DataLoader(torch.randn(8, max(WIDTHS)), batch_size=4)
    strategy = RegionalCompileStrategy(backend="eager", keep_if_faster=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, strategy, 2).fit(model, data)
    return model, caught


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (RegionNotCompiledWarning, PerInstanceRecompileWarning))
    ]


def test_a_sweep_over_widths_compiles_every_trial_and_says_what_it_dropped(tmp_path):
    """Each trial's model is dropped before the next (as an Optuna objective's is): the
    graphs of gone models are dropped once they fill half the limit, so every trial runs
    compiled, and its report says what was dropped. Losses equal plain Lightning's."""
    assert recompile_limit() == 8  # torch's default, which the widths are sized against
    dropped_in = []
    for index, width in enumerate(WIDTHS):
        model, caught = trial(tmp_path, width)
        report = region_report(model)
        assert not report.ran_eager and ours(caught) == [], (width, ours(caught))
        assert sum(row.graphs for row in report.rows) == 2, (width, report)
        if report.dropped:
            assert report.dropped == ("SweptBlock.forward: 4 graph(s)",)
            assert "graphs of models of these classes no longer alive" in str(report)
            dropped_in.append(index)
        if width == WIDTHS[-1]:
            plain = Swept(width)
            data = torch.utils.data.DataLoader(torch.randn(8, max(WIDTHS)), batch_size=4)
            trainer(tmp_path, "auto", 2).fit(plain, data)
            assert model.losses == pytest.approx(plain.losses, rel=1e-6)
        del model
    assert dropped_in == [2, 4]  # two trials fill half the limit: the third drops them


def test_graphs_of_models_still_alive_are_kept_and_the_next_is_told_why_it_ran_eager(
    tmp_path,
):
    """Models kept alive (a notebook holding every trial's): their graphs are kept, and
    the model that finds the limit full runs eager with a warning that says so and names
    the fixes, not a per-instance diagnosis."""
    kept = []
    for width in WIDTHS[:5]:
        model, caught = trial(tmp_path, width)
        kept.append(model)
    report = region_report(model)
    assert len(report.ran_eager) == 4 and not report.dropped
    assert report.limit_filled_before == (("SweptBlock", 8),)
    (said,) = ours(caught)
    assert said.startswith("RegionNotCompiledWarning: SweptBlock at blocks.0-3 ran eager: its ")
    assert "already holds 8 compiled graph(s) in this process" in said
    assert "torch.compiler.reset()" in said and "drop your references" in said
    assert graphs_held(SweptBlock.forward.__code__) == 8  # the live models' graphs
    del kept, model
    gc.collect()


@pytest.mark.parametrize("how", ["config", "stance"])
def test_torch_compile_turned_off_is_named_once_and_nothing_is_timed(tmp_path, how):
    """torch.compile turned off in the process (``TORCH_COMPILE_DISABLE=1``, which sets
    ``torch._dynamo.config.disable``, or ``torch.compiler.set_stance("force_eager")``):
    every region runs eager, one warning says why, the setup report says so, no
    per-instance diagnosis, and the gate times nothing. Losses equal plain Lightning's."""
    if how == "config":
        turned_off = torch._dynamo.config.patch(disable=True)
    else:
        turned_off = torch.compiler.set_stance("force_eager")
    model, plain = Swept(16), Swept(16)
    data = torch.utils.data.DataLoader(torch.randn(8, max(WIDTHS)), batch_size=4)
    strategy = RegionalCompileStrategy(backend="eager")
    with turned_off, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, strategy, 14).fit(model, data)
        report = region_report(model)
    trainer(tmp_path, "auto", 14).fit(plain, data)
    (said,) = ours(caught)
    cause = "config.disable is True" if how == "config" else 'set_stance("force_eager")'
    assert said.startswith("RegionNotCompiledWarning: 4 region(s) ran eager: torch.compile is ")
    assert cause in said and "blocks.0-3" in said
    assert "torch.compile is turned off in this process (" in str(report)
    assert strategy.payoff is None and not report.per_instance
    assert model.losses == pytest.approx(plain.losses, rel=1e-6)
