"""Tiny transformers models from their own configs (no downloads), at a real depth: the
one place that sets their widths, for the benchmarks and the tests alike.

``tiny(transformers.LlamaConfig, width=32, heads=2)`` builds a config with every size
field the class takes set from ``width`` and ``heads`` (heads' width, feed-forward and
expert widths, low ranks), 12 layers, a small vocabulary, and the fields passed kept as
given; ``shrink(config)`` does the same to a config already built (every family of the
causal-LM sweep), sub-configs too.
"""

from __future__ import annotations

import inspect
from typing import Any

DEPTH, VOCAB, WIDTH, HEADS, POSITIONS = 12, 128, 64, 4, 128

LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
SECTIONS = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def sizes(
    width: int = WIDTH,
    heads: int = HEADS,
    vocab: int = VOCAB,
    depth: int = DEPTH,
    positions: int = POSITIONS,
) -> dict[str, int]:
    """Every size field's value, by the names the transformers configs give it."""
    head = width // heads
    names: dict[tuple[str, ...], int] = {
        ("hidden_size", "n_embd", "d_model", "embedding_size"): width,
        ("attention_hidden_size", "emb_dim", "dim"): width,
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ): heads,
        ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"): min(2, heads),
        ("head_dim", "qk_head_dim", "v_head_dim", "attention_head_dim"): head,
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "n_inner",
            "ffn_hidden_size",
            "d_ff",
            "d_inner",
        ): 2 * width,
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "expert_intermediate_size",
        ): width // 2,
        ("num_experts", "num_local_experts", "n_routed_experts"): 4,
        ("moe_num_experts", "num_experts_per_layer"): 4,
        ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k"): 2,
        ("n_group", "topk_group", "num_expert_group"): 1,
        ("kv_lora_rank", "q_lora_rank"): width // 4,
        ("qk_rope_head_dim", "qk_nope_head_dim"): head // 2,
        ("vocab_size",): vocab,
        ("max_position_embeddings", "n_positions", "max_seq_len"): positions,
        (
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "decoder_layers",
            "encoder_layers",
        ): depth,
    }
    return {name: value for group, value in names.items() for name in group}


#: The benchmarks' sizes: width 64, 4 heads, 12 layers.
SIZES = sizes()


def shrink(config: Any, table: dict[str, int] = SIZES, keep: frozenset[str] = frozenset()) -> Any:
    """``config`` with the sizes of ``table`` (but the fields in ``keep``), per-layer lists
    tiled to its depth, and special tokens inside the vocabulary; sub-configs
    (``text_config``...) too."""
    depth, vocab = table["num_hidden_layers"], table["vocab_size"]
    for name, value in list(vars(config).items()):
        if name in keep:
            continue
        if name in table and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, table[name])
        elif name in LAYER_LISTS and isinstance(value, list) and value:
            setattr(config, name, [value[i % len(value)] for i in range(depth)])
        elif name in TOKEN_IDS and isinstance(value, int) and value >= vocab:
            setattr(config, name, 1)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            shrink(value, table)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and "head_dim" not in keep:
        config.head_dim = config.qk_rope_head_dim  # multi-head latent attention's rotary dim
    if all(isinstance(getattr(config, name, None), int) for name in SECTIONS):
        # looped models (dory): input, recurrent and output sections that add up to the
        # depth; the defaults (8 + 20 + 8) would run some layers in two sections, each
        # writing its keys into the same training KV-cache slot
        for name, layers in zip(SECTIONS, (2, depth - 4, 2), strict=True):
            setattr(config, name, layers)
    return config


def tiny(
    config_class: Any,
    *,
    width: int = WIDTH,
    heads: int = HEADS,
    vocab: int = VOCAB,
    depth: int = DEPTH,
    positions: int = POSITIONS,
    **fields: Any,
) -> Any:
    """A ``config_class`` config built with the sizes it takes (so fields it derives at
    construction follow them), then shrunk; ``fields`` are passed and kept as given."""
    table = sizes(width, heads, vocab, depth, positions)
    accepted = inspect.signature(config_class).parameters
    built = {name: value for name, value in table.items() if name in accepted}
    return shrink(config_class(**{**built, **fields}), table, frozenset(fields))
