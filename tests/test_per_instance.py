"""One graph per block class on real decoders at depth: per-instance recompiles found,
explained and removed.

transformers' GPT-2 and Llama at 12 layers (config defaults, tiny widths) trained as
people write it, ``model(input_ids=x, labels=x).loss``, against plain Lightning; and
synthetic blocks whose per-layer attribute makes dynamo guard on the instance.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import transformers
from helpers import (
    VOCAB,
    CausalLM,
    LayerIndexBlock,
    fit_stack,
    gpt2,
    llama,
    token_batches,
    trainer,
)
from torch import nn

from benchmarks.tiny_transformers import tiny
from lightning_regions import (
    PerInstanceRecompileWarning,
    RegionalCompileStrategy,
    RegionNotCompiledWarning,
    compat,
    region_report,
)
from lightning_regions.core.kv_cache import disable_kv_cache_unless_asked, restore_kv_cache

STEPS = 3


def fit(tmp_path, module: pl.LightningModule, strategy) -> pl.LightningModule:
    torch.manual_seed(1)  # GPT-2's dropout draws the same masks in both runs
    trainer(tmp_path, strategy, STEPS, validate=True).fit(module, token_batches(), token_batches())
    return module


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_real_decoders_at_depth_compile_one_graph_per_mode_and_equal_plain(tmp_path, build):
    ours = CausalLM(build)
    plain = CausalLM(build)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerInstanceRecompileWarning)
        warnings.simplefilter("error", RegionNotCompiledWarning)
        fit(tmp_path, ours, RegionalCompileStrategy(backend="aot_eager"))
    fit(tmp_path, plain, "auto")
    report = region_report(ours)
    assert len(report.rows) == ours.model.config.num_hidden_layers == 12
    assert report.graphs <= 2  # the sanity check's eval graph and the training graph
    assert not report.never_ran_compiled and not report.per_instance
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)
    assert ours.cache_in_validation == [False]  # not asked for: off, so one eval graph
    assert plain.cache_in_validation == [True]
    assert not ours.model._forward_pre_hooks  # teardown took the training hook off
    assert not torch._dynamo.config.allow_unspec_int_on_nn_module  # and torch's flag back


def test_with_the_training_cache_kept_the_per_layer_guard_is_named_at_the_first_step(tmp_path):
    """Before: the cache on in training, as transformers defaults it."""
    model = CausalLM(gpt2)
    strategy = RegionalCompileStrategy(backend="aot_eager", disable_training_kv_cache=False)
    with pytest.warns(PerInstanceRecompileWarning, match="is_initialized") as caught:
        fit(tmp_path, model, strategy)
    message = str(next(w.message for w in caught if w.category is PerInstanceRecompileWarning))
    assert "GPT2Block: 8 graph(s) from 8 of 12 instances, 4 left eager" in message
    assert "cache_utils.py" in message and "disable_training_kv_cache=True" in message
    (entry,) = region_report(model).per_instance
    assert entry.instances_eager == 4 and entry.limit_hits == 1
    assert "PER-INSTANCE RECOMPILES: GPT2Block" in str(region_report(model))


def test_the_hook_turns_the_cache_off_unless_the_caller_asks_for_it():
    torch.manual_seed(0)
    model, ids = gpt2().eval(), torch.randint(0, VOCAB, (2, 8))
    expected = model(input_ids=ids).logits
    assert disable_kv_cache_unless_asked(nn.ModuleDict({"lm": model})) == ["lm"]
    assert disable_kv_cache_unless_asked(model) == [""]  # a second call adds no hook
    assert len(model._forward_pre_hooks) == 1
    for mode in (model.train, model.eval):
        mode()
        assert model(input_ids=ids).past_key_values is None
        assert model(input_ids=ids, use_cache=True).past_key_values is not None  # caller chose
    torch.testing.assert_close(model(input_ids=ids).logits, expected)  # only the cache differs
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)  # passes use_cache
    restore_kv_cache(model)
    assert not model._forward_pre_hooks and model.config.use_cache
    assert torch.equal(generated, model.generate(ids, max_new_tokens=3, do_sample=False))
    assert model(input_ids=ids).past_key_values is not None


def kv_cache_of(output: object) -> object:
    """The KV cache a transformers output returns (``cache`` from 5.24, before that
    ``past_key_values``), or None."""
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def test_the_hook_reaches_a_cache_built_inside_a_model_whose_forward_takes_no_use_cache():
    # GraniteMoeForCausalLM.forward takes no use_cache (transformers 5.24) and hands its
    # **kwargs to GraniteMoeModel, which builds the cache: 4 of 12 layers ran eager in the
    # causal-LM sweep before the hook passed the keyword on
    torch.manual_seed(0)
    config = tiny(
        transformers.GraniteMoeConfig,
        width=32,
        heads=2,
        vocab=VOCAB,
        depth=2,
        intermediate_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    model, ids = transformers.GraniteMoeForCausalLM(config).eval(), torch.randint(0, VOCAB, (2, 8))
    expected = model(input_ids=ids)
    assert kv_cache_of(expected) is not None
    assert disable_kv_cache_unless_asked(model) == [""]
    assert kv_cache_of(model(input_ids=ids)) is None
    assert kv_cache_of(model(input_ids=ids, use_cache=True)) is not None  # the caller chose
    torch.testing.assert_close(model(input_ids=ids).logits, expected.logits)
    restore_kv_cache(model)
    assert kv_cache_of(model(input_ids=ids)) is not None


def test_the_hook_is_set_where_only_the_text_config_turns_the_cache_on():
    # FuyuConfig has no use_cache of its own; its text_config's turns the cache on in the
    # language model inside (so in Gemma 3 and GOT-OCR2): 4 of 12 layers ran eager in the
    # sweep while the hook looked at the outer config only
    config = transformers.FuyuConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        patch_size=2,
        num_channels=1,
        text_config={
            "model_type": "persimmon",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
    )
    model, ids = transformers.FuyuForCausalLM(config).eval(), torch.randint(0, VOCAB, (2, 8))
    assert config.text_config.use_cache  # FuyuConfig has a use_cache of its own in 5.0, not 5.24
    assert kv_cache_of(model(input_ids=ids)) is not None
    assert disable_kv_cache_unless_asked(model) == [""]
    assert kv_cache_of(model(input_ids=ids)) is None
    restore_kv_cache(model)


# Synthetic blocks: a per-layer attribute read in forward.


class DropPathBlock(nn.Module):
    """A stochastic-depth schedule: each layer's own float rate, scaling its branch."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop_prob = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x) * (1.0 - self.drop_prob)


def activation_of_its_own_class(index: int):
    """A per-instance callable whose class differs per layer (a factory per layer)."""
    return type(f"Activation{index}", (), {"__call__": lambda self, t: torch.tanh(t)})()


class CallableBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.activation = activation_of_its_own_class(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.activation(self.proj(x))


def test_a_drop_path_float_schedule_is_reported_with_its_cost(tmp_path):
    model, warned = fit_stack(tmp_path, lambda: [DropPathBlock(0.1 * i / 11) for i in range(12)])
    report = region_report(model)
    (entry,) = report.per_instance
    assert "`self.drop_prob == 0.0`" in str(entry)
    if compat.FLOAT_ATTRIBUTE_SYMBOLIC_AFTER_FIRST_CHANGE.applies:
        # torch specialises the first value, then compiles it symbolic on the first change:
        # bounded, so reported (with the one-graph fix), not warned about
        assert warned == [] and entry.bounded
        assert report.graphs == 2 and not report.never_ran_compiled
        assert sum(row.graphs > 0 for row in report.rows) == 2
        assert "graphs of DropPathBlock: 2 graph(s) from 2 of 12 instances" in str(report)
        assert "register_buffer" in entry.fix
    else:  # torch < 2.13 specialises every instance's value until the recompile limit
        (message,) = warned
        assert report.graphs == 8 and len(report.never_ran_compiled) == 4
        assert "DropPathBlock: 8 graph(s) from 8 of 12 instances, 4 left eager" in message
        assert "PER-INSTANCE RECOMPILES: DropPathBlock" in str(report)
        assert "tensor buffer" in message


def test_a_specialised_float_schedule_is_reported_by_its_guard(tmp_path):
    with torch._dynamo.config.patch(specialize_float=True):
        _, warned = fit_stack(tmp_path, lambda: [DropPathBlock(0.1 * i / 11) for i in range(12)])
    (message,) = warned
    assert "DropPathBlock: 8 graph(s) from 8 of 12 instances, 4 left eager" in message
    assert "`self.drop_prob == 0.0`" in message and "test_per_instance.py" in message
    assert "specialize_float" in message


def test_a_per_layer_int_compiles_symbolic_after_its_first_change(tmp_path):
    model, warned = fit_stack(tmp_path, lambda: [LayerIndexBlock(i) for i in range(12)])
    report = region_report(model)
    assert report.graphs == 2 and not report.never_ran_compiled  # constant, then symbolic
    assert warned == []  # bounded whatever the depth: reported, not warned about
    (entry,) = report.per_instance
    assert entry.bounded and "LayerIndexBlock: 2 graph(s) from 2 of 12 instances" in str(entry)
    assert "`self.layer_idx == 0`" in str(entry) and "register_buffer" in entry.fix


def test_a_per_layer_int_without_the_flag_is_reported_with_the_fix(tmp_path):
    _, warned = fit_stack(
        tmp_path, lambda: [LayerIndexBlock(i) for i in range(12)], unspecialize_module_ints=False
    )
    (message,) = warned
    assert "LayerIndexBlock: 8 graph(s) from 8 of 12 instances, 4 left eager" in message
    assert "`self.layer_idx == 0`" in message and "unspecialize_module_ints=True" in message


def test_a_per_instance_callable_class_is_reported_by_its_guard(tmp_path):
    model, warned = fit_stack(tmp_path, lambda: [CallableBlock(i) for i in range(12)])
    (message,) = warned
    assert "CallableBlock: 8 graph(s) from 8 of 12 instances, 4 left eager" in message
    assert "___check_type_id(self.activation" in message
    assert "the same object and class" in message
    assert len(region_report(model).never_ran_compiled) == 4


def test_the_int_flag_is_restored_when_the_last_holder_lets_go():
    from lightning_regions.strategies.environment import UnspecializedModuleInts

    assert not torch._dynamo.config.allow_unspec_int_on_nn_module
    UnspecializedModuleInts.acquire()
    UnspecializedModuleInts.acquire()  # a second strategy in the same process
    UnspecializedModuleInts.release()
    assert torch._dynamo.config.allow_unspec_int_on_nn_module  # the other one still holds it
    UnspecializedModuleInts.release()
    assert not torch._dynamo.config.allow_unspec_int_on_nn_module
