"""The real inductor backend on a tiny GPT (g++ kernels: slow on CPU, so one model)."""

from __future__ import annotations

import copy

import pytest
import torch

from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import compile_regions, region_report


@pytest.mark.inductor
def test_inductor_in_place_matches_eager_outputs_and_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = GPTConfig(vocab_size=17, block_size=8, n_layer=3, n_head=2, n_embd=16, unique_blocks=2)
    model = TinyGPT(config)
    eager = copy.deepcopy(model)
    idx = torch.randint(0, 17, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)

    compiled = compile_regions(model, inplace=True)
    compiled.loss(idx, targets).backward()
    eager.loss(idx, targets).backward()

    torch.testing.assert_close(compiled(idx), eager(idx), rtol=1e-4, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    report = region_report(compiled)
    assert len(report.rows) == 2 and not report.never_ran_compiled
    assert compiled.lm_head.weight is compiled.wte.weight
