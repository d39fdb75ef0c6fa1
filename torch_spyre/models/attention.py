"""Attention of stock transformers models on the card's flash-attention program.

Most models reach it through SDPA (``attn_implementation="sdpa"``):
``F.scaled_dot_product_attention`` on spyre tensors is the flash program
(``ops/attention.py``), with masks (padding, sliding windows), grouped and
multi-query KV heads and a V head size unlike Q's (MLA).  Two variants
SDPA cannot express: logit **soft-capping** (Gemma-2: transformers then
forces its eager attention, a matmul/tanh/softmax/matmul chain) and
attention **sinks** (a learned per-head logit in the softmax, GPT-OSS).
For those we register ``"spyre"`` in transformers' public
``AttentionInterface`` (and its mask function in ``AttentionMaskInterface``:
the eager one, an additive float mask always built, because the models that
need the variants support only eager attention and their code may extend
the mask assuming that form: DeepSeek-V4 concatenates its compressed-KV
block bias onto it, which SDPA's boolean or skipped mask turned into wrong
attention): the layer's call goes to
``spyre::attention_ext``, the same flash program with the cap and the sink
as steps of the online softmax (off the card the op computes them written
out).  Anything else it is handed goes to transformers' own SDPA function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torch_spyre.ops.attention import _math_ext

NAME = "spyre"


def spyre_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = softcap is None and s_aux is None
    if plain or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.dim() == 4 and mask.shape[-1] != kv_len:
        mask = mask[:, :, :, :kv_len]
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = bool(q_len > 1 and mask is None and is_causal)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, s_aux)
    )
    # the op has no backward: training takes the variants written out (autograd)
    attend = _math_ext if grad else torch.ops.spyre.attention_ext
    out = attend(query, key, value, mask, scale, is_causal, float(softcap or 0.0), s_aux)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add ``"spyre"`` to transformers' attention and attention-mask registries (public API)."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        eager_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    import torch_spyre.ops.attention  # noqa: F401  (defines spyre::attention_ext)

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, spyre_attention_forward)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(NAME, eager_mask)


def needs_variants(model: nn.Module) -> list[str]:
    """What the model's attention has that SDPA cannot express."""
    cfg = getattr(model, "config", None)
    found = []
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    if getattr(text, "attn_logit_softcapping", None):
        found.append(f"logit soft-capping {text.attn_logit_softcapping:g}")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        found.append("attention sinks")
    return found


def attention_variants(model: nn.Module, options: Any) -> str | None:
    """Route soft-capped / sink attention to the flash program (see above)."""
    found = needs_variants(model)
    if not found or not hasattr(model, "set_attn_implementation"):
        return None
    if not model._can_set_attn_implementation():
        return None
    register()
    model.set_attn_implementation(NAME)
    return f"attention: {NAME} (flash program with {', '.join(found)})"
