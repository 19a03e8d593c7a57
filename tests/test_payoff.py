"""Compile that pays, or steps aside (``keep_if_faster``, ``payoff.py``): the strategy
times the run's own steps compiled, then eager, and keeps the faster; a revert keeps
training as eager would, with the tie, the parameters, the optimizer and the keys."""

from __future__ import annotations

import pytest
import torch
from helpers import SlowAotEager, data, gpt, trainer
from torch import nn

from lightning_regions import RegionalCompileStrategy, TiedWeightsCheck, region_report
from lightning_regions.payoff import SETTLE, WINDOW

#: Optimizer steps until the decision: the first compiled, the settling ones, both windows.
DECIDED_AFTER = 1 + SETTLE + 2 * WINDOW + 1
STEPS = DECIDED_AFTER + 2


def blocks(model) -> list[nn.Module]:
    return list(dict.fromkeys(model.model.blocks))


def test_a_backend_slower_than_eager_is_reverted_and_training_goes_on_as_eager(tmp_path, caplog):
    model, plain, check = gpt(), gpt(), TiedWeightsCheck()
    keys = list(model.state_dict())
    strategy = RegionalCompileStrategy(backend=SlowAotEager())
    with caplog.at_level("INFO"):
        fitted = trainer(tmp_path, strategy, STEPS, [check])
        fitted.fit(model, data())
    trainer(tmp_path, "auto", STEPS).fit(plain, data())
    decision = strategy.payoff.decision
    assert decision is not None and not decision.kept
    assert decision.compiled_ms > decision.eager_ms + 20  # 3 blocks x 30 ms a step
    said = f"compiled {decision.compiled_ms:.1f} ms vs eager {decision.eager_ms:.1f} ms a step"
    assert f"{said}: regions reverted to eager" in caplog.text
    assert f"on this run's steps: {said}: regions reverted to eager" in str(region_report(model))
    assert all(block._compiled_call_impl is None for block in blocks(model))
    assert model.losses == pytest.approx(plain.losses, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert check.broken == [] and model.model.lm_head.weight is model.model.wte.weight
    assert list(model.state_dict()) == keys
    optimizer = fitted.optimizers[0]
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len(set(held)) == len(list(model.parameters()))


def test_no_decision_before_the_windows_end_and_none_when_turned_off(tmp_path):
    early = RegionalCompileStrategy(backend=SlowAotEager())
    model = gpt()
    trainer(tmp_path, early, SETTLE + WINDOW).fit(model, data())  # before the eager window
    assert early.payoff.decision is None
    assert all(block._compiled_call_impl is not None for block in blocks(model))
    off = RegionalCompileStrategy(backend=SlowAotEager(), keep_if_faster=False)
    model = gpt()
    trainer(tmp_path, off, STEPS).fit(model, data())
    assert off.payoff is None
    assert all(block._compiled_call_impl is not None for block in blocks(model))
    assert "on this run's steps" not in str(region_report(model))


class PointwiseBlock(nn.Module):
    """48 chained pointwise ops: inductor fuses them into one kernel each way, where eager
    runs (and dispatches) 48 (here, 6 blocks: eager 6.0 ms a forward and backward,
    compiled 1.9 ms, measured alone)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(12):
            y = torch.tanh(y) * self.scale + 0.5 * torch.sigmoid(y)
        return y


class PointwiseStack(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PointwiseBlock(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.inductor
def test_a_clearly_faster_compile_is_kept(tmp_path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = PointwiseStack()

        def training_step(self, batch, batch_idx):
            return self.model(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: no OpenMP barrier in a tiny kernel beside a busy one
    strategy = RegionalCompileStrategy()
    batches = torch.utils.data.DataLoader(torch.randn(STEPS * 64, 64), batch_size=64)
    module = Module()
    try:
        trainer(tmp_path, strategy, STEPS).fit(module, batches)
    finally:
        torch.set_num_threads(threads)
    decision = strategy.payoff.decision
    assert decision is not None and decision.kept, decision
    assert decision.compiled_ms < 0.8 * decision.eager_ms, decision
    assert all(block._compiled_call_impl is not None for block in module.model.blocks)
