"""Attention over a paged KV cache as one kernel program per call.

``spyre::paged_attention(out, query, kv_cache, q_rows, kv_rows, mask, ...)``
is the attention of a batch of requests whose keys and values sit in vLLM's
paged cache ([2, blocks, block_size, kv_heads, head_size]: keys then
values, token-major pages).  ``q_rows`` [R, Q] int32 holds the token row of
each request's query positions (-1: padding), ``kv_rows`` [R, S] int32 the
cache slot of each of its context positions (padding masked), ``mask``
[R, 1, Q, S] bool what each query sees (causal after the cached context, a
sliding window).  On the card this is ``kernels.flash`` with ``PagedKV``: the
cores read the slot tables into LX, then the K/V pages straight from the
cache (one DMA descriptor per page), the flash-attention loop in LX, and
scatter each query's output row into ``out`` [T, H, D]; no gathered copy of
the context is written to device memory.  Soft-capped logits and attention
sinks are the flash program's variants.

When no tiling fits the LX the same computation runs as separate kernels
on the card (gathers, then ``spyre::attention_ext``), as does a CPU call.
"""

from __future__ import annotations

import torch

from torch_spyre.ir import Buffer, Dim, Load, Operand, Program, Store
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.ops import attention
from torch_spyre.runtime import cards, dispatch_stats, launch, operands


@torch.library.custom_op("spyre::paged_attention", mutates_args=("out",))
def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    q_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    block_size: int,
) -> None:
    """out[q_rows[r, j]] = attention of query row q_rows[r, j] over the cache
    slots kv_rows[r] under mask[r, 0, j]; out and query [T, H, D]."""
    if sinks is not None:
        sinks = sinks.to(query.device)
    if query.device.type == "spyre" and _device(
        out, query, kv_cache, q_rows, kv_rows, mask, scale, softcap, sinks, block_size
    ):
        return
    _separate_kernels(out, query, kv_cache, q_rows, kv_rows, mask, scale, softcap, sinks)


@paged_attention.register_fake
def _(out, query, kv_cache, q_rows, kv_rows, mask, scale, softcap, sinks, block_size):
    return None


def _device(out, query, kv_cache, q_rows, kv_rows, mask, scale, softcap, sinks, block) -> bool:
    from torch_spyre.kernels.flash import PagedKV, best_flash_attention

    t, h, d = query.shape
    kvh = kv_cache.shape[-2]
    if (
        h % kvh
        or kv_cache.shape[-1] != d
        or kv_cache.dtype != query.dtype
        or out.dtype != query.dtype
        or tuple(out.shape) != (t, h, d)
        or not operands.is_whole_default(kv_cache)
    ):
        return False
    g = h // kvh
    slots = kv_cache.numel() // (2 * kvh * d)
    r, q = q_rows.shape
    s = kv_rows.shape[1]
    dev = query.device
    softcap = float(softcap) if softcap else None
    key = (
        "paged_attention", r, h, kvh, q, s, d, t, slots, int(block), query.dtype,
        float(scale), softcap, sinks is not None,
    )  # fmt: skip

    def build() -> launch.Kernel:
        p = best_flash_attention(
            r, h, kvh, q, s, d, query.dtype, scale=float(scale),
            mask=((r, 1, q, s), torch.bool), softcap=softcap, sinks=sinks is not None,
            paged=PagedKV(t, slots, int(block)), config=cards.config(dev.index or 0),
        )  # fmt: skip
        return launch.Kernel(p)

    try:
        kern = launch.kernel(key, build)
    except Exception:  # no tiling fits: separate kernels instead
        return False
    if kern.program is None:
        return False

    # The program reads and writes [T, kv_heads, group, D]: the bytes of a
    # whole [T, H, D] or [T, H * D] tensor when D is whole sticks (checked once
    # per shape); such a query and output are used in place.
    def in_place(x: torch.Tensor) -> torch.Tensor | None:
        return operands.in_shape(x, (t, kvh, g, d))

    direct = in_place(out)
    # otherwise a copy: rows this call does not write keep their values
    target = direct if direct is not None else out.reshape(t, kvh, g, d).clone()
    qbase = in_place(query)
    qmem = (
        operands.device_memory(qbase)
        if qbase is not None
        else operands.memory(query.reshape(t, kvh, g, d))
    )
    bufs = {
        "q": qmem,
        "kv": operands.device_memory(kv_cache),
        "q_rows": operands.memory(q_rows.to(torch.int32)),
        "kv_rows": operands.memory(kv_rows.to(torch.int32)),
        "mask": operands.memory(mask),
        "out": operands.memory(target),
    }
    if sinks is not None:
        bufs["sinks"] = operands.memory(sinks.float().reshape(kvh, g))
    kern.launch_memory(dev.index or 0, bufs)
    if direct is None:
        out.copy_(target.view(t, h, d))
    dispatch_stats.record("kernel", "paged_attention")
    return True


@torch.library.custom_op("spyre::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """kv_cache[0|1] row slots[t] = key|value[t]: a step's new keys and values
    into their pages, one kernel (a scatter store through the slot table)."""
    if key.device.type == "spyre" and _device_write(kv_cache, key, value, slots):
        return
    pages = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    rows = slots.to(torch.int64)
    pages[0].index_copy_(0, rows, key.to(kv_cache.dtype))
    pages[1].index_copy_(0, rows, value.to(kv_cache.dtype))


@kv_cache_write.register_fake
def _(kv_cache, key, value, slots):
    return None


def _write_program(t: int, kvh: int, d: int, slots: int, dtype: torch.dtype, cores: int) -> Program:
    """Tokens over the cores; each loads its rows' keys, values and slots,
    and stores both into the cache (one descriptor per token fetches its
    adjacent key and value sticks)."""
    lay = SpyreTensorLayout.default
    loop = ("t",)  # 32-token tiles: any step's tokens fit the LX
    return Program(
        name=f"kv_cache_write_{t}x{kvh}x{d}",
        dims=(Dim("t", t, min(t, cores), 32), Dim("h", kvh), Dim("d", d)),
        operands=(
            Operand("key", lay((t, kvh, d), dtype)),
            Operand("value", lay((t, kvh, d), dtype)),
            Operand("slots", lay((t,), torch.int32)),
            Operand("kv", lay((2, slots, kvh, d), dtype), "inout"),
        ),
        buffers=(
            Buffer("sl", ("t",), torch.int32),
            Buffer("kt", ("t", "h", "d"), dtype),
            Buffer("vt", ("t", "h", "d"), dtype),
        ),
        steps=(
            Load("sl", "slots", ("t",), loop),
            Load("kt", "key", ("t", "h", "d"), loop),
            Load("vt", "value", ("t", "h", "d"), loop),
            Store("kv", "kt", (None, "t", "h", "d"), loop, (0, 0, 0, 0), "sl", 1),
            Store("kv", "vt", (None, "t", "h", "d"), loop, (1, 0, 0, 0), "sl", 1),
        ),
        loop_order=loop,
    )


def _device_write(kv_cache, key, value, slots) -> bool:
    t, kvh, d = key.shape
    if (
        tuple(value.shape) != (t, kvh, d)
        or tuple(kv_cache.shape[-2:]) != (kvh, d)
        or key.dtype != kv_cache.dtype
        or value.dtype != kv_cache.dtype
        or not operands.is_whole_default(kv_cache)
    ):
        return False
    n = kv_cache.numel() // (2 * kvh * d)
    dev = key.device
    kern = launch.kernel(
        ("kv_cache_write", t, kvh, d, n, key.dtype),
        lambda: launch.Kernel(
            _write_program(t, kvh, d, n, key.dtype, cards.config(dev.index or 0).cores)
        ),
    )
    if kern.program is None:
        return False
    kern.launch_memory(
        dev.index or 0,
        {
            "key": operands.memory(key),
            "value": operands.memory(value),
            "slots": operands.memory(slots.to(torch.int32)),
            "kv": operands.device_memory(kv_cache),
        },
    )
    dispatch_stats.record("kernel", "kv_cache_write")
    return True


def _separate_kernels(out, query, kv_cache, q_rows, kv_rows, mask, scale, softcap, sinks):
    """The same attention as gathers and one attention kernel (on the card or
    the CPU, wherever the tensors are)."""
    t, h, d = query.shape
    kvh = kv_cache.shape[-2]
    r, q = q_rows.shape
    s = kv_rows.shape[1]
    pages = kv_cache.view(2, -1, kvh, d)
    slots = kv_rows.reshape(-1).to(torch.int64).clamp(min=0)
    k = pages[0].index_select(0, slots).view(r, s, kvh, d).transpose(1, 2)
    v = pages[1].index_select(0, slots).view(r, s, kvh, d).transpose(1, 2)
    rows = q_rows.reshape(-1).to(torch.int64)
    qq = query.index_select(0, rows.clamp(min=0)).view(r, q, h, d).transpose(1, 2)
    o = attention.attention_ext(
        qq.contiguous(), k.contiguous(), v.contiguous(), mask, float(scale), False,
        float(softcap or 0.0), sinks,
    )  # fmt: skip
    o = o.transpose(1, 2).reshape(r * q, h, d)
    keep = (rows >= 0).nonzero().flatten()
    out.index_copy_(0, rows.index_select(0, keep), o.index_select(0, keep).to(out.dtype))
