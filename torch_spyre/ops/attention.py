"""Scaled dot-product attention as one flash-attention kernel program.

``spyre::attention(q, k, v, mask, scale, is_causal)`` runs
``kernels.basic.best_flash_attention`` on the card: per block of queries the
Q tile stays in LX, K/V tiles stream through, ``q @ k^T`` on the PE array,
online softmax on the vector units, ``p @ v`` accumulated in LX; scores never
reach device memory.  Grouped KV heads (``hq = g * hk``) are read once per
group, causal blocks above the diagonal are skipped, a boolean or additive
mask is applied per tile.

``F.scaled_dot_product_attention`` on spyre tensors reaches it in eager mode
and under ``torch.compile``: the op is registered at the
``AutogradPrivateUse1`` key of ``aten::scaled_dot_product_attention`` (before
PyTorch's composite decomposes it), so a traced graph holds one
``spyre.attention`` node, which Inductor runs as a fallback kernel calling
this device kernel (counted as ``kernel``, never a host fallback).  What the
kernel does not serve (dropout, gradients, other ranks, a mask together with
``is_causal``, a V head size unlike Q's) takes PyTorch's math decomposition,
op by op on the card, as before; so does a graph planned with
``kernels.options.planning(naive=True)`` (the baseline).
"""

from __future__ import annotations

import math

import torch

from torch_spyre.runtime import access, cards, dispatch_stats, launch, operands
from torch_spyre.runtime.registration import entry

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op(
    "spyre::attention",
    mutates_args=(),
    # no layout tag: the compiler's constraint for the three attention ops
    # (compiler/implicit_fallbacks._kv_rows_in_place) stores every operand
    # contiguous (the kernel reads whole default-layout tensors: a strided
    # producer would need two re-lays) except K and V that are a static
    # cache's first rows, which the program reads in place (a tag would
    # take precedence over it, ``lowering.maybe_layout_constraints``)
)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, q [B, Hq, Sq, D], k/v [B, Hk, Skv, D]."""
    if q.device.type == "spyre":
        out = _device_attention(q, k, v, mask, scale, is_causal)
        if out is not None:
            return out
    return _math(q, k, v, mask, scale, is_causal)


@attention.register_fake
def _(q, k, v, mask, scale, is_causal):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(
    "spyre::attention_bshd",
    mutates_args=(),  # no layout tag: as spyre::attention
)
def attention_bshd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """``attention(...).transpose(1, 2).contiguous()``: [B, Sq, Hq, D], the
    token-major layout an output projection reads, stored so by the flash
    program itself (the compiler pass routes ``clone(permute(attention))``
    here)."""
    if q.device.type == "spyre":
        out = _device_attention(q, k, v, mask, scale, is_causal, heads_last=True)
        if out is not None:
            return out
    return _math(q, k, v, mask, scale, is_causal).transpose(1, 2).contiguous()


@torch.library.custom_op(
    "spyre::attention_ext",
    mutates_args=(),  # no layout tag: as spyre::attention
)
def attention_ext(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``attention`` with logit soft-capping (``softcap > 0``: ``s = softcap *
    tanh(s / softcap)`` before the mask) and per-head sinks (``sinks`` [Hq]: a
    logit in each row's softmax that attends to nothing); q [B, Hq, Sq, D],
    k [B, Hk, Skv, D], v [B, Hk, Skv, Dv]."""
    if q.device.type == "spyre" and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype:
        out = _device_attention(q, k, v, mask, scale, is_causal, softcap=softcap, sinks=sinks)
        if out is not None:
            return out
    return _math_ext(q, k, v, mask, scale, is_causal, softcap, sinks)


@attention_ext.register_fake
def _(q, k, v, mask, scale, is_causal, softcap, sinks):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _math_ext(q, k, v, mask, scale, is_causal, softcap, sinks):
    """The variants written out (fp32 softmax, as transformers' eager attention)."""
    hq, hk = q.shape[1], k.shape[1]
    if hk != hq:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    sq, skv = s.shape[-2], s.shape[-1]
    if is_causal:
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    s = s.float()
    if sinks is not None:
        sk = sinks.float().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.cat([s, sk], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    p = torch.nan_to_num(p)  # a fully masked row attends to nothing
    return torch.matmul(p.to(v.dtype), v)


@attention_bshd.register_fake
def _(q, k, v, mask, scale, is_causal):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))


def _math(q, k, v, mask, scale, is_causal, dropout_p=0.0, enable_gqa=None):
    """PyTorch's math path, as ``scaled_dot_product_attention`` takes it (a
    boolean mask becomes an additive -inf mask first: a fully masked row
    then gives 0, as SDPA does)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            mask.logical_not(), float("-inf")
        )
    gqa = k.shape[-3] != q.shape[-3] if enable_gqa is None else enable_gqa
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=gqa
    )[0]


_positions: dict[tuple[int, int], torch.Tensor] = {}


def _position(device: torch.device, n: int) -> torch.Tensor:
    """0..n-1 (fp32) on the card, made once per card and length."""
    key = (device.index or 0, n)
    t = _positions.get(key)
    if t is None:
        if len(_positions) > 256:
            _positions.clear()
        t = _positions[key] = torch.arange(n, dtype=torch.float32).to(device)
    return t


def _mask_operand(mask: torch.Tensor, b: int, hq: int, sq: int, skv: int):
    """The mask as a whole [Bm, Hm, Sm, Km] tensor (each full or 1), or None."""
    m = mask
    if m.dim() > 4:
        return None
    while m.dim() < 4:
        m = m.unsqueeze(0)
    full = (b, hq, sq, skv)
    for i in range(4):
        if m.shape[i] != 1 and m.shape[i] != full[i]:
            return None
        if m.shape[i] > 1 and m.stride(i) == 0:  # expanded: read one copy
            m = m.narrow(i, 0, 1)
    return operands.whole(m)


def _row_prefix(t: torch.Tensor) -> torch.Tensor | None:
    """The whole default-layout tensor [b, h, S, d] whose first rows of each
    head ``t`` [b, h, n, d] is (``x[:, :, :n]``, n < S: a static cache's rows
    written so far, as transformers slices them for a prefill), or None."""
    # strides first (no storage lookup): a whole K or V, every call of a
    # decode step, has heads n * d apart, a prefix S * d > n * d
    if t.dim() != 4 or t.storage_offset() != 0 or t.stride(1) <= t.shape[2] * t.shape[3]:
        return None
    shape = tuple(access.storage_layout(t).host_size)
    if (
        len(shape) != 4
        or shape[2] <= t.shape[2]
        or shape[:2] + shape[3:] != t.shape[:2] + t.shape[3:]
    ):
        return None
    base = t.as_strided(shape, (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1))
    if t.stride() != base.stride() or not operands.is_whole_default(base):
        return None
    return base


def _device_attention(q, k, v, mask, scale, is_causal, heads_last=False, softcap=None, sinks=None):
    from torch_spyre import kernels

    b, hq, sq, d = q.shape
    hk, skv = k.shape[1], k.shape[2]
    dv = v.shape[-1]
    if hq % hk:
        return None
    # K and V read in place when they are the first rows of longer ones
    kb, vb = _row_prefix(k), _row_prefix(v)
    kv_rows = None
    if kb is not None and vb is not None and kb.shape[2] == vb.shape[2]:
        k, v, kv_rows = kb, vb, kb.shape[2]
    m = None
    if mask is not None:
        m = _mask_operand(mask, b, hq, sq, skv)
        if m is None:
            return None
    dev = q.device
    minfo = (tuple(m.shape), m.dtype) if m is not None else None
    softcap = float(softcap) if softcap else None
    key = (
        "attention", b, hq, hk, sq, skv, d, q.dtype, bool(is_causal), float(scale), minfo,
        heads_last, dv, softcap, sinks is not None, kv_rows,
    )  # fmt: skip

    def build() -> launch.Kernel:
        p = kernels.best_flash_attention(
            b, hq, hk, sq, skv, d, q.dtype, causal=bool(is_causal), scale=float(scale),
            mask=minfo, heads_last=heads_last, dv=None if dv == d else dv, softcap=softcap,
            sinks=sinks is not None, kv_rows=kv_rows, config=cards.config(dev.index or 0),
        )  # fmt: skip
        return launch.Kernel(p)

    try:
        kern = launch.kernel(key, build)
    except Exception:  # no tiling fits: the math decomposition runs instead
        return None
    if kern.program is None:
        return None
    oshape = (b, sq, hq, dv) if heads_last else (b, hq, sq, dv)
    out = torch.empty(oshape, dtype=q.dtype, device=dev)
    bufs = {
        "q": operands.device_memory(operands.whole(q)),
        "k": operands.device_memory(operands.whole(k)),
        "v": operands.device_memory(operands.whole(v)),
        "out": operands.device_memory(out),
    }
    if m is not None:
        bufs["mask"] = operands.device_memory(m)
    if is_causal:
        bufs["qpos"] = operands.device_memory(_position(dev, sq))
        bufs["kvpos"] = operands.device_memory(_position(dev, skv))
    if sinks is not None:
        bufs["sinks"] = operands.device_memory(operands.whole(sinks.float().reshape(hk, hq // hk)))
    kern.launch_memory(dev.index or 0, bufs)
    dispatch_stats.record("kernel", "attention")
    return out


def _routable(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    if dropout_p or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mask) if t is not None):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _FLOATS):
        return False
    b, hq, _, d = q.shape
    # a V head size unlike Q's is served (MLA)
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        return False
    hk = k.shape[1]
    # one KV head broadcasts over the query heads (multi-query: Falcon) as SDPA's
    # batch broadcasting does; several need enable_gqa
    if hk != hq and not ((enable_gqa or hk == 1) and hk and hq % hk == 0):
        return False
    if mask is not None and (
        is_causal or not (mask.dtype == torch.bool or mask.is_floating_point())
    ):
        return False
    if any(t.device != q.device for t in (k, v, mask) if t is not None):
        return False
    from torch_spyre.kernels import options

    return not options.current().naive


def _sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if _routable(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        return torch.ops.spyre.attention(query, key, value, attn_mask, s, bool(is_causal))
    return _math(query, key, value, attn_mask, scale, is_causal, dropout_p, enable_gqa)


_lib: torch.library.Library | None = None


def register() -> None:
    global _lib
    if _lib is None:
        _lib = torch.library.Library("aten", "IMPL")
        _lib.impl("scaled_dot_product_attention", entry(_sdpa), "AutogradPrivateUse1")
