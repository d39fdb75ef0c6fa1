"""Tensor parallel for estimates: one card's shard of a model, the collectives
it adds, and how many cards a model needs.

The shard is what vLLM's parallel layers put on each of ``tp`` cards:
attention heads split (KV heads split too, or replicated one per card when
there are fewer KV heads than cards), the MLP's / experts' intermediate dim
split, the vocabulary split (embedding and LM head); norms replicated.  Per
forward of ``tokens`` tokens the cards all-reduce the hidden state after the
embedding and twice per decoder layer (attention out, MLP / experts out) and
all-gather the logits of the last positions (sim/interconnect.py's times).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from torch_spyre.runtime.cards import MAX_CARDS


def load_config(path: str):
    """A transformers config from a ``config.json`` file or a folder holding
    one (a multimodal checkpoint: its language model's ``text_config``)."""
    import transformers

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a transformers config from {path!r}: {e}") from None
    if "model_type" not in values:
        raise ValueError(f"{file}: no 'model_type' (is it a transformers config.json?)")
    cfg = transformers.AutoConfig.for_model(**values)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return text


def check_tp(cfg, tp: int) -> None:
    """vLLM's rules for splitting a model over ``tp`` cards."""
    if not 1 <= tp <= MAX_CARDS:
        raise ValueError(f"--tp must be 1..{MAX_CARDS} (cards in a Spyre system), got {tp}")
    # a heterogeneous config (Gemma 4) has its head counts per layer
    layers = cfg.per_layer_config if getattr(cfg, "is_heterogeneous", False) else [cfg]
    for lc in layers:
        heads, kv = lc.num_attention_heads, lc.num_key_value_heads
        if heads % tp:
            raise ValueError(
                f"--tp {tp}: the model's {heads} attention heads do not split over {tp} cards; "
                f"use a divisor of {heads}"
            )
        if kv % tp and tp % kv:
            raise ValueError(
                f"--tp {tp}: {kv} KV heads neither split over {tp} cards nor replicate evenly"
            )


def shard_config(cfg, tp: int):
    """The config of one card's shard (see the module docstring).

    A heterogeneous config (Gemma 4: head_dim and KV heads differ on its full
    attention layers) is sharded by the same rule layer by layer: its global
    values as any model's, and each layer's overrides (KV heads split, or one
    per card when fewer than the cards; head_dim unchanged)."""
    check_tp(cfg, tp)
    if tp == 1:
        return cfg
    s = copy.deepcopy(cfg)
    overrides = {}
    if getattr(cfg, "is_heterogeneous", False):
        overrides = copy.deepcopy(cfg._heterogeneity_spec.per_layer_overrides)
        s.per_layer_config = None  # the global values, readable again
    head_dim = getattr(s, "head_dim", None) or s.hidden_size // s.num_attention_heads
    s.head_dim = head_dim
    names = (*_SPLIT, "num_key_value_heads")
    for name, v in _shard_values({n: getattr(s, n, None) for n in names}, tp).items():
        setattr(s, name, v)
    s.vocab_size = -(-cfg.vocab_size // tp)
    if overrides:
        s.per_layer_config = {i: {**o, **_shard_values(o, tp)} for i, o in overrides.items()}
    # Gemma-style 1/sqrt(head_dim) scaling reads query_pre_attn_scalar, unchanged
    return s


_SPLIT = ("num_attention_heads", "intermediate_size", "moe_intermediate_size",
          "shared_expert_intermediate_size")  # fmt: skip


def _shard_values(values: dict[str, Any], tp: int) -> dict[str, int]:
    """One card's share of the split sizes among ``values`` (a config's global
    values or one layer's overrides): query heads and intermediate dims split;
    KV heads split, or one per card when there are fewer KV heads than cards."""
    out = {}
    for name in _SPLIT:
        v = values.get(name)
        if isinstance(v, int) and v:
            out[name] = -(-v // tp)
    kv = values.get("num_key_value_heads")
    if isinstance(kv, int) and kv:
        out["num_key_value_heads"] = max(1, kv // tp)
    return out


def collective_parts(
    cfg, tp: int, batch: int, tokens: int, itemsize: int, n_layers: int
) -> list[tuple[str, float]]:
    """(what, modelled seconds) of one forward's collectives on ``tp`` cards."""
    from torch_spyre.runtime import cards
    from torch_spyre.sim.interconnect import collective_time

    if tp == 1:
        return []
    hw = cards.config()
    hidden = batch * tokens * cfg.hidden_size * itemsize
    logits = batch * (-(-cfg.vocab_size // tp)) * tp * itemsize  # last positions only
    ar = collective_time("all_reduce", _sticks(hidden), tp, hw)
    return [
        ("all_reduce embedding", ar),
        (f"all_reduce hidden x {2 * n_layers} (2 per layer)", 2 * n_layers * ar),
        ("all_gather logits", collective_time("all_gather", _sticks(logits), tp, hw)),
    ]


def _sticks(nbytes: int) -> int:
    return -(-nbytes // 128) * 128


def card_weight_bytes(cfg, tp: int, dtype: torch.dtype) -> int:
    """Parameter bytes on one card of a ``tp``-card split (meta model: exact counts)."""
    import transformers

    shard = shard_config(cfg, tp)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(shard, dtype=dtype)
    n = sum(p.numel() for p in m.parameters())
    return n * dtype.itemsize


def cards_needed(
    cfg, dtype: torch.dtype, card_bytes: int, per_card: dict[int, int] | None = None
) -> int | None:
    """The fewest cards (a valid TP size) whose per-card memory fits, or None."""
    for tp in range(1, MAX_CARDS + 1):
        try:
            check_tp(cfg, tp)
        except ValueError:
            continue
        need = per_card.get(tp) if per_card else None
        if need is None:
            continue
        if need <= card_bytes:
            return tp
    return None


def kv_bytes_per_card(cfg, tp: int, batch: int, cache_len: int, itemsize: int, kinds) -> int:
    """KV cache bytes on one card: its KV heads' keys and values."""
    shard = shard_config(cfg, tp)
    hetero = getattr(shard, "is_heterogeneous", False)  # Gemma 4: per-layer head shapes
    window = getattr(cfg, "sliding_window", None)
    total = 0
    for i, kind in enumerate(kinds):
        lc = shard.per_layer_config[i] if hetero else shard
        head_dim = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
        length = min(window, cache_len) if kind == "sliding_attention" and window else cache_len
        total += 2 * lc.num_key_value_heads * length * head_dim * itemsize
    return total * batch


def summary(per_card: dict[int, int], card_bytes: int) -> dict[str, Any]:
    return {str(k): {"bytes": v, "fits": v <= card_bytes} for k, v in sorted(per_card.items())}
