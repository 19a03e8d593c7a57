"""Evaluation that generates: a ``validation_step`` that calls ``generate()``, the sanity
check on and off, then ``predict``, on transformers' GPT-2 and Llama at 12 layers.

Training keeps its one compiled graph per block class whatever evaluation does; the
generated tokens and ``predict``'s logits are eager's; a region that reaches the
recompile limit in a later phase is warned about at the end of that phase. Eager block
calls are counted by a hook that runs only outside compiled code, independent of our
report."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import VOCAB, gpt2, llama, trainer

from lightning_regions import (
    PerInstanceRecompileWarning,
    RecompileStormWarning,
    RegionalCompileStrategy,
    RegionNotCompiledWarning,
)
from lightning_regions.compat import recompile_limit
from lightning_regions.core.kv_cache import EagerGenerate

PROMPTS = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 6
OUR_WARNINGS = (PerInstanceRecompileWarning, RecompileStormWarning, RegionNotCompiledWarning)


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.transformer.h if hasattr(model, "transformer") else model.model.layers)


class EagerCalls:
    """Decoder-layer calls that ran as Python, by phase. The forward pre-hook sits on each
    layer's first child: a layer's compiled graph inlines it (traced, it counts nothing),
    and a layer run eager calls it as Python. (On the layer itself dynamo would compile
    the hook as a frame of its own, with ``is_compiling()`` folded in.)"""

    def __init__(self) -> None:
        self.phase = "setup"
        self.counts: dict[str, int] = {}

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1


class Generating(pl.LightningModule):
    """A decoder fine-tuned with a ``validation_step`` that generates greedily (or, with
    ``own_loop``, decodes step by step with the KV cache by hand)."""

    def __init__(self, build, own_loop: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build()
        # transformers logs "loss_type=None" once from a model built from a config, a graph
        # break in a decoder compiled whole (nested) outside its blocks; a fine-tune's
        # model has its loss type
        self.model.loss_type = "ForCausalLM"
        self.own_loop = own_loop
        self.eager_calls = EagerCalls()
        for layer in layers(self.model):
            next(layer.children()).register_forward_pre_hook(self.eager_calls)
        self.losses: list[float] = []
        self.generated: list[list[list[int]]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.eager_calls.phase = "training"
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.eager_calls.phase = "sanity" if self.trainer.sanity_checking else "validation"
        if self.own_loop:
            self.generated.append(decode_by_hand(self.model).tolist())
        else:
            out = self.model.generate(
                PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            self.generated.append(out[:, PROMPTS.shape[1] :].tolist())

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.eager_calls.phase = "predict"
        return self.model(input_ids=batch).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def decode_by_hand(model: torch.nn.Module) -> torch.Tensor:
    """Greedy decoding with the KV cache, the way a user's own loop does it."""
    out = model(input_ids=PROMPTS, use_cache=True)
    tokens = []
    for _ in range(NEW_TOKENS):
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


def batches() -> torch.utils.data.DataLoader:
    data = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(data, batch_size=2)


def train_and_predict(module: Generating, strategy: Any, sanity: bool) -> torch.Tensor:
    run = trainer(
        None,
        strategy,
        4,
        limit_val_batches=1,
        num_sanity_val_steps=1 if sanity else 0,
        val_check_interval=2,
    )
    torch.manual_seed(1)  # GPT-2's dropout draws the same masks in every run
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    run.fit(module, batches(), batches())
    module.graphs_after_fit = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    return run.predict(module, batches())[0]


@pytest.fixture(scope="module")
def eager_runs() -> dict[str, tuple[Generating, torch.Tensor]]:
    runs = {}
    for build in (gpt2, llama):
        module = Generating(build)
        runs[build.__name__] = (module, train_and_predict(module, "auto", sanity=True))
    return runs


@pytest.mark.parametrize("sanity", [True, False], ids=["sanity-check", "no-sanity-check"])
@pytest.mark.parametrize("granularity", ["regions", "nested"])
@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_generating_validation_leaves_training_compiled_and_generates_eagers_tokens(
    eager_runs, build, granularity, sanity
):
    module = Generating(build)
    # every training step compiled: the keep-or-revert gate's eager turns are off here
    strategy = RegionalCompileStrategy(
        backend="aot_eager", granularity=granularity, keep_if_faster=False
    )
    with warnings.catch_warnings():
        for category in OUR_WARNINGS:
            warnings.simplefilter("error", category)
        logits = train_and_predict(module, strategy, sanity=sanity)
    eager, eager_logits = eager_runs[build.__name__]
    assert module.eager_calls.counts.get("training", 0) == 0  # 4 steps x 12 layers compiled
    assert module.eager_calls.counts["validation"] > 0  # generate() ran eager, as planned
    assert module.graphs_after_fit == 1  # one training graph (nested: the decoder's)
    # the sanity check's tokens (if it ran) and both validations' are eager's
    assert module.generated == eager.generated[(0 if sanity else 1) :]
    assert len(module.generated) == (3 if sanity else 2)
    assert module.losses == pytest.approx(eager.losses, rel=1e-5)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)
    assert "generate" not in module.model.__dict__  # the wrapper is gone after teardown


@pytest.mark.parametrize("sanity", [False, True], ids=["later-validation", "sanity-check"])
def test_a_fallback_in_validation_is_warned_naming_the_class_phase_and_cause(sanity):
    module = Generating(gpt2, own_loop=True)  # decoding by hand: per-layer cache guards
    strategy = RegionalCompileStrategy(backend="aot_eager", keep_if_faster=False)
    with pytest.warns(RegionNotCompiledWarning) as caught:
        train_and_predict(module, strategy, sanity=sanity)
    fallbacks = [str(w.message) for w in caught if "reached dynamo's recompile" in str(w.message)]
    assert len(fallbacks) == 1, fallbacks  # one per class, where it happened
    phase = "the validation sanity check" if sanity else "validation"
    assert f"GPT2Block reached dynamo's recompile limit (8) during {phase}" in fallbacks[0]
    assert "KV cache outside generate()" in fallbacks[0]
    assert not [w for w in caught if w.category is RecompileStormWarning]  # said once
    assert module.eager_calls.counts["validation"] > 0
    # torch still runs the graphs it has: training's, if it compiled before the limit
    training_eager = module.eager_calls.counts.get("training", 0)
    assert training_eager == (4 * 12 if sanity else 0)
    assert ("training has not compiled its graph yet" in fallbacks[0]) == sanity


def test_a_fallback_in_predict_is_warned_at_the_end_of_predict():
    class DecodesInPredict(Generating):
        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            pass

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return decode_by_hand(self.model)

    module = DecodesInPredict(llama)
    with pytest.warns(RegionNotCompiledWarning, match=r"LlamaDecoderLayer .*during predict") as w:
        strategy = RegionalCompileStrategy(backend="aot_eager", keep_if_faster=False)
        train_and_predict(module, strategy, sanity=False)
    (fallback,) = [str(x.message) for x in w if "during predict" in str(x.message)]
    assert "the graphs it has still run" in fallback  # training compiled in fit, before


def test_the_storm_threshold_is_below_torchs_recompile_limit():
    assert RegionalCompileStrategy().reporter.threshold == recompile_limit() - 1
    assert RegionalCompileStrategy(recompile_warn_threshold=3).reporter.threshold == 3
    assert RegionalCompileStrategy(recompile_warn_threshold=None).reporter.threshold is None
    with pytest.raises(ValueError, match=r"recompile_warn_threshold=0: use a positive count"):
        RegionalCompileStrategy(recompile_warn_threshold=0)


def test_a_model_held_with_eager_generation_pickles_and_copies_as_a_plain_model():
    model = gpt2()
    model.__dict__["generate"] = EagerGenerate(model.generate)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert not isinstance(copied.__dict__.get("generate"), EagerGenerate)
        out = copied.generate(PROMPTS, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert out.shape == (2, PROMPTS.shape[1] + 2)


def varying_lengths(lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, n), generator=generator) for n in lengths]


def fit_lengths(module: Generating, strategy: Any, lengths: list[int]) -> None:
    loader = torch.utils.data.DataLoader(varying_lengths(lengths), batch_size=None)
    trainer(None, strategy, len(lengths)).fit(module, loader)


def test_variable_lengths_under_dynamic_none_recompile_once_then_run_symbolic():
    module = Generating(gpt2)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        for category in OUR_WARNINGS:
            warnings.simplefilter("error", category)
        # compiled through every step: the keep-or-revert gate's eager turns are off here
        strategy = RegionalCompileStrategy(backend="aot_eager", keep_if_faster=False)
        fit_lengths(module, strategy, [16, 24, 32, 20, 28, 12])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    assert module.eager_calls.counts.get("training", 0) == 0


def test_variable_lengths_under_dynamic_false_warn_of_the_storm_before_the_limit():
    module = Generating(gpt2)
    # compiled through every step: the storm is what is tested (payoff: test_payoff.py)
    strategy = RegionalCompileStrategy(backend="aot_eager", dynamic=False, keep_if_faster=False)
    with pytest.warns(UserWarning) as caught:
        fit_lengths(module, strategy, [8 + 2 * n for n in range(10)])  # 10 shapes
    ours = [w for w in caught if w.category in (RecompileStormWarning, RegionNotCompiledWarning)]
    assert [w.category for w in ours] == [RecompileStormWarning, RegionNotCompiledWarning]
    assert "GPT2Block recompiled 7 times (threshold 7" in str(ours[0].message)
    assert "limit (8) during training" in str(ours[1].message)
    assert "shape changed" in str(ours[1].message)
    assert module.eager_calls.counts["training"] == 2 * 12  # shapes 9 and 10: no graph left
