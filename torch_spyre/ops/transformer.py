"""PyTorch's transformer fast paths on the card.

In eval mode, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
take a "fast path" on every device PyTorch lists as supported, PrivateUse1
included: one native op each, ``_native_multi_head_attention`` and
``_transformer_encoder_layer_fwd``, with CPU and CUDA kernels only (they
took the host fallback).  Here each is its math, the slow path's, written
with the ops the card runs: ``F.multi_head_attention_forward`` (its
projections are matmul programs, its attention the flash program) and the
layer's norms and feed-forward.  Outputs are the fast path's: batch-first,
and no weights unless asked for.
"""

from __future__ import annotations

import torch.nn.functional as F

from torch_spyre.ops.registry import kernel


def _masks(mask, mask_type, b: int, heads: int, lq: int, lk: int):
    """(attn_mask, key_padding_mask) of the fast path's merged mask: type 0 is
    an attention mask [L, S], 1 a key padding mask [B, S], 2 both merged
    [B, H, L, S] (``nn.MultiheadAttention.merge_masks``)."""
    if mask is None:
        return None, None
    if mask_type == 1:
        return None, mask
    if mask_type == 2 or mask.dim() == 4:
        return mask.expand(b, heads, lq, lk).reshape(b * heads, lq, lk), None
    return mask, None


@kernel("_native_multi_head_attention.default")
def _native_mha(
    query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
    mask=None, need_weights=True, average_attn_weights=True, mask_type=None,
):  # fmt: skip
    b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
    attn_mask, kpm = _masks(mask, mask_type, b, num_head, lq, lk)
    out, weights = F.multi_head_attention_forward(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), embed_dim, num_head,
        qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias,
        training=False, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights,
    )  # fmt: skip
    out = out.transpose(0, 1)
    if weights is None:
        weights = query.new_empty(0)
    return out, weights


@kernel("_transformer_encoder_layer_fwd.default")
def _encoder_layer(
    src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
    norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
    ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None,
):  # fmt: skip
    def attend(x):
        return _native_mha(
            x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
            mask, False, True, mask_type,
        )[0]  # fmt: skip

    def feed_forward(x):
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        h = F.gelu(h) if use_gelu else F.relu(h)
        return F.linear(h, ffn_weight_2, ffn_bias_2)

    def norm(x, w, b_):
        return F.layer_norm(x, (embed_dim,), w, b_, eps)

    x = src
    if norm_first:
        x = x + attend(norm(x, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attend(x), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)
