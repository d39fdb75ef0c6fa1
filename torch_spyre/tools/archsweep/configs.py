"""Tiny configs of every model type the installed transformers ships.

A type's config class is built from its own defaults with the sizes shrunk:
the shrink names the size attributes models use (hidden, layers, heads,
intermediate, experts, latent ranks, vocabulary, positions) and leaves every
other default alone, so each architecture keeps its own structure (its norms,
activations, rotary variant, layer pattern, router) at a size the simulated
card runs in seconds.  Sub-configs (``text_config`` and the like) shrink the
same way.  The config class derives what depends on the shrunk sizes itself:
the shrunk values go to its constructor, not onto a finished object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import transformers
from transformers.models.auto import configuration_auto, modeling_auto

Family = Literal["causal-lm", "encoder"]

HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
VOCAB = 256
POSITIONS = 128
#: ``--wide``: heads of 64 (half a head one fp32 stick: the head-split and
#: RoPE epilogues of the projections program apply) and prompts of 64
#: tokens (the row count where the norm and projections fuse)
WIDE_HIDDEN = 256


def _size_table(hidden: int) -> dict[str, int]:
    """attribute -> shrunk value (applied where the default is larger), for
    models ``hidden`` wide (heads of ``hidden // HEADS``)."""
    HIDDEN, HEAD_DIM = hidden, hidden // HEADS  # noqa: N806 (the table's names)
    return {
        # widths
        "hidden_size": HIDDEN,
        "d_model": HIDDEN,
        "n_embd": HIDDEN,
        "embed_dim": HIDDEN,
        "model_dim": HIDDEN,
        "dim": HIDDEN,
        "embedding_size": HIDDEN,
        "word_embed_proj_dim": HIDDEN,
        "hidden_dim": HIDDEN,
        # heads
        "num_attention_heads": HEADS,
        "n_head": HEADS,
        "n_heads": HEADS,
        "num_heads": HEADS,
        "encoder_attention_heads": HEADS,
        "decoder_attention_heads": HEADS,
        "head_dim": HEAD_DIM,
        "rotary_dim": HEAD_DIM // 2,
        "d_kv": HEAD_DIM,
        "attention_head_size": HEAD_DIM,
        "kv_channels": HEAD_DIM,
        "num_key_value_heads": 2,
        "num_kv_heads": 2,
        "n_head_kv": 2,
        "multi_query_group_num": 2,
        # feed-forward
        "intermediate_size": 2 * HIDDEN,
        "ffn_dim": 2 * HIDDEN,
        "n_inner": 2 * HIDDEN,
        "d_ff": 2 * HIDDEN,
        "ffn_hidden_size": 2 * HIDDEN,
        "encoder_ffn_dim": 2 * HIDDEN,
        "decoder_ffn_dim": 2 * HIDDEN,
        "inner_hidden_size": 2 * HIDDEN,
        "dense_intermediate_size": 2 * HIDDEN,
        # mixtures of experts
        "num_experts": 4,
        "num_local_experts": 4,
        "n_routed_experts": 4,
        "moe_num_experts": 4,
        "num_experts_per_tok": 2,
        "num_experts_per_token": 2,
        "moe_k": 2,
        "top_k": 2,
        "moe_topk": 2,
        "moe_intermediate_size": HIDDEN,
        "expert_intermediate_size": HIDDEN,
        "shared_expert_intermediate_size": HIDDEN,
        "shared_intermediate_size": 2 * HIDDEN,
        "n_shared_experts": 1,
        "num_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        # latent attention
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": HEAD_DIM,
        "qk_nope_head_dim": HEAD_DIM,
        "v_head_dim": HEAD_DIM,
        "index_head_dim": HEAD_DIM,
        "index_n_heads": 2,
        # state-space and linear-attention layers
        "mamba_n_heads": HEADS,
        "mamba_d_head": 2 * HEAD_DIM,
        "mamba_d_state": 16,
        "state_size": 16,
        "ssm_state_size": 16,
        "mamba_n_groups": 1,
        "n_groups": 1,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": HEAD_DIM,
        "linear_value_head_dim": HEAD_DIM,
        "time_step_rank": 8,
        "lru_width": HIDDEN,
        # vocabulary and positions
        "vocab_size": VOCAB,
        "max_position_embeddings": POSITIONS,
        "n_positions": POSITIONS,
        "n_ctx": POSITIONS,
        "max_seq_len": POSITIONS,
        "seq_length": POSITIONS,
        "sliding_window": 8,
        "attention_window": 8,
        "num_buckets": 8,
        "max_distance": 32,
    }


_SIZES = _size_table(HIDDEN)

_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
)

#: attributes holding one entry per layer (truncated, keeping every kind)
_PER_LAYER = (
    "layer_types",
    "layers_block_type",
    "block_types",
    "hybrid_override_pattern",
    "attn_layer_indices",
    "mlp_only_layers",
    "block_type",
)

_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
    "image_token_id",
    "image_token_index",
)


@dataclass(frozen=True)
class ModelType:
    name: str
    family: Family
    model_class: str


def model_types() -> list[ModelType]:
    """Every causal-LM type, then every masked-LM (encoder) type that is not also
    a causal LM, of the installed transformers."""
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    out = [ModelType(t, "causal-lm", c) for t, c in sorted(causal.items())]
    out += [ModelType(t, "encoder", c) for t, c in sorted(masked.items()) if t not in causal]
    return out


def _layer_pattern(values: list[Any], n: int) -> list[Any]:
    """The first ``n`` entries, widened so that every distinct kind appears once."""
    kinds: list[Any] = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
    head = list(values[:n])
    for k in kinds:
        if k not in head:
            head.append(k)
    return head


def _shrunk_kwargs(
    cfg: transformers.PretrainedConfig, sizes: dict[str, int] = _SIZES
) -> dict[str, Any]:
    """Constructor arguments that shrink ``cfg`` (a default instance)."""
    aliases = set(getattr(type(cfg), "attribute_map", {}) or {})
    kw: dict[str, Any] = {}
    own = vars(cfg)
    for name, small in sizes.items():
        if name in aliases or name not in own:
            continue
        v = own[name]
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        if name in ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"):
            kw[name] = 1 if v == 1 else small  # keep multi-query attention multi-query
        elif v > small:
            kw[name] = small
    layers = LAYERS
    for name in _PER_LAYER:
        v = own.get(name)
        if isinstance(v, list | tuple) and v and not isinstance(v[0], int):
            pattern = _layer_pattern(list(v), LAYERS)
            kw[name] = pattern
            layers = max(layers, len(pattern))
        elif isinstance(v, str) and len(v) > LAYERS:  # a pattern string, one char a layer
            pattern = "".join(_layer_pattern(list(v), LAYERS))
            kw[name] = pattern
            layers = max(layers, len(pattern))
    for name in _LAYER_COUNTS:
        if name in own and name not in aliases and isinstance(own[name], int) and own[name] > 0:
            kw[name] = min(own[name], layers) if own[name] < LAYERS else layers
    for name in ("first_k_dense_replace", "num_dense_layers"):
        if isinstance(own.get(name), int) and own[name] > 1:
            kw[name] = 1
    vocab = kw.get("vocab_size", own.get("vocab_size"))
    if isinstance(vocab, int):
        for name in _TOKEN_IDS:
            v = own.get(name)
            if isinstance(v, int) and v >= vocab:
                kw[name] = vocab - 1 - _TOKEN_IDS.index(name)
            elif isinstance(v, list) and any(isinstance(x, int) and x >= vocab for x in v):
                kw[name] = [min(x, vocab - 1) for x in v]
    for name, v in own.items():
        if isinstance(v, transformers.PretrainedConfig):
            kw[name] = _shrunk_kwargs(v, sizes)
    return kw


#: second tries, for a type whose first tiny config does not run on the CPU:
#: every query head its own KV head (latent attention and some others need it)
VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"num_key_value_heads": HEADS, "num_kv_heads": HEADS, "n_head_kv": HEADS},
)


def tiny_config(
    model_type: str, variant: int = 0, hidden: int = HIDDEN
) -> transformers.PretrainedConfig:
    """The type's config class built from its defaults with the sizes shrunk
    (``variant``: an index into ``VARIANTS``; ``hidden``: the width, heads of
    ``hidden // HEADS``)."""
    cls = configuration_auto.CONFIG_MAPPING[model_type]
    default = cls()
    kw = _shrunk_kwargs(default, _SIZES if hidden == HIDDEN else _size_table(hidden))
    kw.update({k: v for k, v in VARIANTS[variant].items() if k in kw})
    cfg = cls(**kw)
    # a layer-type list a config derived from the old depth is cut to the new one
    n = getattr(cfg, "num_hidden_layers", None)
    types = getattr(cfg, "layer_types", None)
    if isinstance(n, int) and isinstance(types, list) and len(types) != n:
        cfg.layer_types = _layer_pattern(types, n)[:n] if len(types) > n else types
    return cfg
