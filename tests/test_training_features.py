"""The strategy with the training features people use, against plain Lightning:
bf16-mixed, gradient checkpointing, accumulation with clipping, EMA; and a model
without repeated blocks, whose fallback regions must really run compiled."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import data, gpt, trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from models import WIDTH, Flat
from torch import nn

from lightning_regions import (
    NoRepeatedBlocksWarning,
    RegionalCompileStrategy,
    TiedWeightsCheck,
    region_report,
)

FEATURES = {
    "bf16_mixed": ({}, {"precision": "bf16-mixed"}),
    "gradient_checkpointing": ({"gradient_checkpointing": True}, {}),
    "accumulation_and_clipping": ({}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
    "ema": ({}, {}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_training_features_match_plain_lightning(tmp_path, feature):
    model_kwargs, trainer_kwargs = FEATURES[feature]
    compiled, plain = gpt(**model_kwargs), gpt(**model_kwargs)
    plain.load_state_dict(compiled.state_dict())

    def callbacks() -> list[pl.Callback]:
        ema = [EMAWeightAveraging(decay=0.5)] if feature == "ema" else []
        return [TiedWeightsCheck(), *ema]

    compiled_callbacks, plain_callbacks = callbacks(), callbacks()
    strategy = RegionalCompileStrategy(backend="aot_eager")
    trainer(tmp_path / "c", strategy, 6, compiled_callbacks, **trainer_kwargs).fit(compiled, data())
    trainer(tmp_path / "p", "auto", 6, plain_callbacks, **trainer_kwargs).fit(plain, data())

    tolerance = 2e-2 if feature == "bf16_mixed" else 1e-5
    assert len(compiled.losses) == len(plain.losses) > 0
    assert compiled.losses == pytest.approx(plain.losses, rel=tolerance)
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=tolerance, atol=tolerance * 1e-2, msg=name)
    assert compiled_callbacks[0].broken == []  # the tie check ran and passed
    assert compiled.model.lm_head.weight is compiled.model.wte.weight
    report = region_report(compiled)
    assert report.rows and not report.never_ran_compiled
    assert all(row.compiled_calls == row.observed_calls for row in report.rows)


class FlatModule(pl.LightningModule):
    """No repeated blocks: the training loop calls ``self.net``, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Flat()
        self.loss_fn = nn.MSELoss()  # a child without parameters: not a region
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def regression_data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, WIDTH, generator=generator)
    return torch.utils.data.DataLoader(list(zip(x, x.sum(-1, keepdim=True), strict=True)), 8)


def test_a_model_without_repeats_trains_with_regions_that_really_ran_compiled(
    tmp_path, counting_backend
):
    compiled, plain = FlatModule(), FlatModule()
    strategy = RegionalCompileStrategy(backend=counting_backend)
    with pytest.warns(NoRepeatedBlocksWarning, match=r"top-level child with parameters.*'net'"):
        trainer(tmp_path, strategy, 4).fit(compiled, regression_data())
    trainer(tmp_path, "auto", 4).fit(plain, regression_data())
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-6)
    assert len(counting_backend.graphs) >= 1  # torch really compiled the region
    (row,) = region_report(compiled).rows
    assert row.paths == ("net",)
    assert row.graphs == len(counting_backend.graphs)
    assert row.compiled_calls == row.observed_calls >= 1
