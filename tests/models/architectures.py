"""Tiny random-weight configs of every architecture the card is validated on.

Sizes are the smallest that exercise the pieces: hidden 64, 4 heads of 16
(2 KV heads), vocab 256, 2 layers (1 for the compiled path: one compile per
model), 4 experts top-2 for mixtures of experts, one Mamba-2 and one
attention layer for the hybrid.  Equivalence against the CPU does not need
trained weights (shared/models.md).
"""

from __future__ import annotations

from collections.abc import Callable

import transformers as t

_D = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_ENC = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)
_GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0)
_SLIDING = dict(head_dim=16, sliding_window=8)

DECODERS: dict[str, Callable[[], t.PretrainedConfig]] = {
    "llama": lambda: t.LlamaConfig(**_D),
    "mistral": lambda: t.MistralConfig(**_D, sliding_window=8),
    "mixtral": lambda: t.MixtralConfig(**_D, **_MOE),
    "qwen2": lambda: t.Qwen2Config(**_D),
    "qwen3": lambda: t.Qwen3Config(**_D, head_dim=16),
    "qwen3_moe": lambda: t.Qwen3MoeConfig(
        **_D, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    ),
    "granite": lambda: t.GraniteConfig(**_D, **_GRANITE),
    "granitemoe": lambda: t.GraniteMoeConfig(**_D, **_MOE, **_GRANITE),
    # Granite 4: a Mamba-2 layer and an attention layer, MoE in both
    "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(
        **_D,
        **_MOE,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        shared_intermediate_size=128,
    ),  # fmt: skip
    "gemma": lambda: t.GemmaConfig(**_D, head_dim=16),
    # soft-capped attention and logits, sliding window on alternate layers
    "gemma2": lambda: t.Gemma2Config(**_D, **_SLIDING),
    "gemma3_text": lambda: t.Gemma3TextConfig(
        **_D, **_SLIDING, layer_types=["sliding_attention", "full_attention"]
    ),
    "gemma4_text": lambda: t.Gemma4TextConfig(
        **_D, **_SLIDING, layer_types=["sliding_attention", "full_attention"]
    ),
    "phi3": lambda: t.Phi3Config(**_D, pad_token_id=0),
    "olmo2": lambda: t.Olmo2Config(**_D),
    "gpt2": lambda: t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
    # partial rotary (a quarter of each head), fused qkv
    "gpt_neox": lambda: t.GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rotary_pct=0.25,
    ),  # fmt: skip
    # multi-query attention, fused qkv
    "falcon": lambda: t.FalconConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),  # fmt: skip
    "starcoder2": lambda: t.Starcoder2Config(**_D),
    # MLA (latent KV, a V head smaller than Q/K's, interleaved rope) and MoE after one dense layer
    "deepseek_v3": lambda: t.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=128,
    ),  # fmt: skip
}

ENCODERS: dict[str, Callable[[], t.PretrainedConfig]] = {
    "bert": lambda: t.BertConfig(**_ENC),
    "roberta": lambda: t.RobertaConfig(**_ENC),
    "xlm-roberta": lambda: t.XLMRobertaConfig(**_ENC),
    "mpnet": lambda: t.MPNetConfig(**_ENC),
    # encoder-decoder: the whole model eagerly, the encoder compiled
    "t5": lambda: t.T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    ),  # fmt: skip
}


def compiled_config(name: str) -> t.PretrainedConfig:
    """The config of the compiled path: one layer (both layer kinds where a
    model mixes them: the hybrid's Mamba and attention layers, DeepSeek's
    dense and MoE layers)."""
    cfg = (DECODERS.get(name) or ENCODERS[name])()
    if name in ("granitemoehybrid", "deepseek_v3"):
        return cfg  # two kinds of layers (Mamba + attention; dense + MoE): both compiled
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, 1)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    return cfg
