"""Flash attention as one kernel program: QK^T, the online softmax and PV per query block.

Variants (each a few vector steps, all in LX): causal tile skipping, a
boolean or additive mask (sliding windows arrive as masks), grouped and
multi-query KV heads (``hq = hk * g``), a V head size unlike Q/K's (MLA:
DeepSeek-V3), logit soft-capping ``cap * tanh(s / cap)`` (Gemma-2) and
per-head attention sinks (a logit in every row's softmax denominator that
attends to nothing: the online softmax starts from ``m = sink, l = 1``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Buffer,
    Dim,
    Load,
    Matmul,
    Operand,
    Program,
    ProgramError,
    Reduce,
    Store,
    Vector,
)
from torch_spyre.kernels.search import persisted
from torch_spyre.layout import SpyreTensorLayout, ceil_div


@dataclass(frozen=True)
class PagedKV:
    """Attention over a paged KV cache (vLLM's): queries gathered from and
    outputs scattered to ``tokens`` token rows, keys and values read page by
    page from a cache of ``slots`` rows ([2, slots, kv_heads, head_size]:
    keys then values), ``block`` consecutive slots per page."""

    tokens: int
    slots: int
    block: int


#: running-max start of the online softmax: finite, so a fully masked row
#: gives exp(-inf - (-3e38)) = 0 (and an output of 0), never inf - inf
_NEG_BIG = -3.0e38


def _greedy_split(sizes: tuple[int, ...], cores: int) -> tuple[int, ...]:
    """Cores over dims in order: each takes as many as it can use."""
    out, rem = [], cores
    for n in sizes:
        p = max(1, min(n, rem))
        out.append(p)
        rem //= p
    return tuple(out)


def flash_attention(
    b: int,
    hq: int,
    hk: int,
    sq: int,
    skv: int,
    d: int,
    dtype: torch.dtype = torch.float16,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: tuple[tuple[int, int, int, int], torch.dtype] | None = None,
    split: tuple[int, int, int, int] | None = None,
    tiles: tuple[int, int] | None = None,
    double_buffer: bool = True,
    out_buffer: bool = True,
    head_tile: int = 1,
    heads_last: bool = False,
    dv: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    paged: PagedKV | None = None,
    kv_rows: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """Scaled dot-product attention in one program (flash attention).

    ``out = softmax(q k^T * scale + mask) v`` per head, grouped KV heads
    (``hq = hk * g``): the ``g`` query heads sharing a KV head sit on one
    core, or on a group of cores that each read 1/g of every K/V tile and
    share it over the ring, so K and V are read once per group.  Per block
    of ``tq`` queries the Q tile stays in LX; K/V tiles of ``tk`` keys stream
    through; ``s = q @ k^T`` on the PE array; the online softmax (running
    max ``m`` and sum ``l``, both rescaled by ``exp(m_old - m_new)``) and the
    rescaled ``o += p @ v`` accumulate in LX; scores never leave the LX.
    ``causal``: keys after the query are masked (top-left aligned, as
    ``is_causal``) and K/V tiles wholly above the diagonal are skipped
    (``Dim.causal_to``).  ``mask``: (shape, dtype) of a 4-D mask
    [B or 1, Hq or 1, Sq or 1, Skv or 1], boolean (True = attend) or
    additive.

    Operands: ``q`` and ``out`` [b, hk, g, sq, d] (the bytes of
    [b, hq, sq, d]), ``k``, ``v`` [b, hk, skv, d], ``mask``, and with
    ``causal`` the positions ``qpos`` [sq], ``kvpos`` [skv] (fp32).
    ``split``: cores over (b, hk, g, sq); ``tiles``: (tq, tk); ``head_tile``:
    KV heads a core takes at once (a paged read of several heads of a page
    is then one transfer, not one per head);
    ``out_buffer``: normalise into a separate (double-buffered) output tile,
    or in place in the fp32 accumulator (less LX: larger query tiles).
    ``heads_last``: ``out`` is [b, sq, hk, g, d] (the bytes of [b, sq, hq,
    d], what ``out.transpose(1, 2).contiguous()`` would give): the store
    writes the rows of each head into the token-major layout the output
    projection reads, so no separate permute pass runs.
    ``dv``: V's (and the output's) head size when it is not ``d`` (MLA).
    ``softcap``: ``s = softcap * tanh(s / softcap)`` after the scale, before
    the mask (Gemma-2).  ``sinks``: operand ``sinks`` [hk, g] fp32, one logit
    per query head that joins every row's softmax and attends to nothing.

    ``kv_rows``: ``k`` and ``v`` are [b, hk, kv_rows, d] and the program reads
    their first ``skv`` rows (a static cache's rows written so far, read
    where they lie: no copy of the prefix; None: ``skv``).

    ``paged``: the operands of vLLM's paged attention instead: ``q`` [T, hk,
    g, d] and ``out`` [T, hk, g, d] token rows, the cache ``kv`` [2, slots,
    hk, d], and two int32 row tables, ``q_rows`` [b, sq] (the token row of
    each request's query position, -1 for padding: not stored) and
    ``kv_rows`` [b, skv] (the cache slot of each context position; padding
    is masked).  The cores load a tile's slots, then its K/V rows page by
    page (one DMA descriptor per page): the cache is read where it lies,
    once per KV-head group, with no gathered copy in device memory.
    Causality and windows come in the ``mask`` (the host knows each
    request's cached length).
    """
    cfg = config or HardwareConfig()
    if hq % hk:
        raise ProgramError(f"flash attention: {hq} query heads do not group over {hk} KV heads")
    if paged is not None and (causal or heads_last or (dv is not None and dv != d)):
        raise ProgramError(
            "paged flash attention: causality comes in the mask, the output is token-major "
            "and V's head size is K's"
        )
    if kv_rows is not None and (kv_rows < skv or paged is not None):
        raise ProgramError(
            f"flash attention: {skv} keys read from {kv_rows} cache rows (paged: {paged})"
        )
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if split is None:
        split = _greedy_split((b, hk, g, sq), cfg.cores)
    pb, ph, pg, pq = split
    eq = ceil_div(sq, pq)
    tq, tk = tiles if tiles is not None else (min(eq, 128), min(skv, 128))
    f32 = torch.float32
    acc = f32 if dtype != torch.float64 else dtype
    e = "d" if dv is None or dv == d else "e"  # V's head dim
    dims = (
        Dim("b", b, pb, 1),
        Dim("h", hk, ph, head_tile),
        Dim("g", g, pg),
        Dim("q", sq, pq, tq),
        Dim("kv", skv, 1, tk, causal_to="q" if causal else None),
        Dim("d", d),
    ) + ((Dim("e", dv),) if e == "e" else ())
    dv = d if dv is None else dv
    l3 = ("b", "h", "q")
    l4 = l3 + ("kv",)
    qi = ("b", "h", "g", "q", "d")
    ki = ("b", "h", "kv", "d")
    vi = ("b", "h", "kv", e)
    oi = ("b", "h", "g", "q", e)
    row = ("b", "h", "g", "q")
    sc = ("b", "h", "g", "q", "kv")
    # a K/V tile is shared by the cores splitting g and q (read once per group)
    kv_mc = pg * pq > 1
    db = double_buffer
    i32 = torch.int32
    if paged is None:
        rows = skv if kv_rows is None else kv_rows
        # a prefix of longer K/V: the loads start at row 0 of each head's rows
        prefix = {"offsets": (0, 0, 0, 0)} if rows != skv else {}
        operands = [
            Operand("q", SpyreTensorLayout.default((b, hk, g, sq, d), dtype), "input"),
            Operand("k", SpyreTensorLayout.default((b, hk, rows, d), dtype), "input"),
            Operand("v", SpyreTensorLayout.default((b, hk, rows, dv), dtype), "input"),
        ]
        steps: list = [Load("qt", "q", qi, l3)]
        kv_loads = [
            Load("kt", "k", ki, l4, multicast=kv_mc, **prefix),
            Load("vt", "v", vi, l4, multicast=kv_mc, **prefix),
        ]
        buffers = []
    else:
        operands = [
            Operand("q", SpyreTensorLayout.default((paged.tokens, hk, g, d), dtype), "input"),
            Operand("kv", SpyreTensorLayout.default((2, paged.slots, hk, d), dtype), "input"),
            Operand("q_rows", SpyreTensorLayout.default((b, sq), i32), "input"),
            Operand("kv_rows", SpyreTensorLayout.default((b, skv), i32), "input"),
        ]
        buffers = [Buffer("qr", ("b", "q"), i32), Buffer("kr", ("b", "kv"), i32, db)]
        steps = [
            Load("qr", "q_rows", ("b", "q"), l3),
            Load("qt", "q", ("q", "h", "g", "d"), l3, rows="qr"),
        ]
        page = {"rows": "kr", "rows_dim": 1, "rows_run": paged.block, "multicast": kv_mc}
        kv_loads = [
            Load("kr", "kv_rows", ("b", "kv"), l4),
            Load("kt", "kv", (None, "kv", "h", "d"), l4, offsets=(0, 0, 0, 0), **page),
            Load("vt", "kv", (None, "kv", "h", e), l4, offsets=(1, 0, 0, 0), **page),
        ]
    buffers += [
        Buffer("qt", qi, dtype, db),
        Buffer("kt", ki, dtype, db),
        Buffer("vt", vi, dtype, db),
        Buffer("s", sc, acc),
        Buffer("p", sc, dtype),
        Buffer("m", row, acc),
        Buffer("mt", row, acc),
        Buffer("al", row, acc),
        Buffer("l", row, acc),
        Buffer("o", oi, acc),
    ]
    y = "y" if out_buffer else "o"
    if out_buffer:
        buffers.append(Buffer("y", oi, dtype, db))
    if sinks:
        # the running max starts at the sink (so it is part of every row's max);
        # its exp(sink - m) joins the sum after the last key tile
        operands.append(Operand("sinks", SpyreTensorLayout.default((hk, g), f32), "input"))
        buffers += [Buffer("sk", ("h", "g"), f32), Buffer("ls", row, acc)]
        steps += [
            Load("sk", "sinks", ("h", "g"), l3),
            Vector("fill", "m", (), (0.0,), l3),
            Vector("add", "m", ("m", "sk"), (), l3),
        ]
    else:
        steps.append(Vector("fill", "m", (), (_NEG_BIG,), l3))
    steps.append(Vector("fill", "l", (), (0.0,), l3))
    steps.append(Vector("fill", "o", (), (0.0,), l3))
    if causal:
        operands += [
            Operand("qpos", SpyreTensorLayout.default((sq,), f32), "input"),
            Operand("kvpos", SpyreTensorLayout.default((skv,), f32), "input"),
        ]
        buffers += [
            Buffer("qp", ("q",), f32, db),
            Buffer("kp", ("kv",), f32, db),
            Buffer("keep", ("q", "kv"), torch.bool),
        ]
        steps.append(Load("qp", "qpos", ("q",), l3))
    steps += [
        *kv_loads,
        Matmul("s", "qt", "kt", l4),
        Vector("mul_scalar", "s", ("s",), (scale,), l4),
    ]
    if softcap:
        steps += [
            Vector("mul_scalar", "s", ("s",), (1.0 / softcap,), l4),
            Vector("tanh", "s", ("s",), (), l4),
            Vector("mul_scalar", "s", ("s",), (float(softcap),), l4),
        ]
    if causal:
        steps += [
            Load("kp", "kvpos", ("kv",), l4),
            Vector("le", "keep", ("kp", "qp"), (), l4),
            Vector("keep_or_fill", "s", ("s", "keep"), (-math.inf,), l4),
        ]
    if mask is not None:
        (mb, mh, mq, mk), mdtype = mask
        if mh > 1:
            mshape: tuple[int, ...] = (mb, hk, g, mq, mk)
            midx: tuple[str | None, ...] = ("b", "h", "g", "q", "kv")
        else:
            mshape, midx = (mb, 1, mq, mk), ("b", None, "q", "kv")
        midx = tuple(
            None
            if (dn is not None and mshape[i] == 1 and dict(b=b, h=hk, g=g, q=sq, kv=skv)[dn] > 1)
            else dn
            for i, dn in enumerate(midx)
        )
        mdims = tuple(x for x in midx if x is not None)
        operands.append(Operand("mask", SpyreTensorLayout.default(mshape, mdtype), "input"))
        buffers.append(Buffer("mk", mdims, mdtype, db))
        group = math.prod(dd.cores for dd in dims if dd.cores > 1 and dd.name not in mdims)
        steps.append(Load("mk", "mask", midx, l4, multicast=group > 1))
        if mdtype == torch.bool:
            steps.append(Vector("keep_or_fill", "s", ("s", "mk"), (-math.inf,), l4))
        else:
            steps.append(Vector("add", "s", ("s", "mk"), (), l4))
    steps += [
        # online softmax: running max (the reduction accumulates over kv tiles)
        Reduce("max", "mt", "s", "kv", l4),
        Vector("maximum", "mt", ("mt", "m"), (), l4),
        Vector("sub", "al", ("m", "mt"), (), l4),
        Vector("exp", "al", ("al",), (), l4),
        Vector("copy", "m", ("mt",), (), l4),
        Vector("sub", "s", ("s", "mt"), (), l4),
        Vector("exp", "p", ("s",), (), l4),
        # rescale the running sum and output, then accumulate this tile
        Vector("mul", "l", ("l", "al"), (), l4),
        Reduce("sum", "l", "p", "kv", l4),
        Vector("mul", "o", ("o", "al"), (), l4),
        Matmul("o", "p", "vt", l4),
    ]
    if sinks:
        steps += [
            Vector("sub", "ls", ("sk", "m"), (), l3),
            Vector("exp", "ls", ("ls",), (), l3),
            Vector("add", "l", ("l", "ls"), (), l3),
        ]
    steps += [
        # normalise once per query block (a fully masked row has o = l = 0)
        Vector("add_scalar", "l", ("l",), (1e-30,), l3),
        Vector("reciprocal", "l", ("l",), (), l3),
        Vector("mul", y, ("o", "l"), (), l3),
    ]
    if paged is not None:
        steps.append(Store("out", y, ("q", "h", "g", e), l3, rows="qr"))
        oshape: tuple[int, ...] = (paged.tokens, hk, g, dv)
    else:
        steps.append(Store("out", y, ("b", "q", "h", "g", e) if heads_last else oi, l3))
        oshape = (b, sq, hk, g, dv) if heads_last else (b, hk, g, sq, dv)
    operands.append(Operand("out", SpyreTensorLayout.default(oshape, dtype), "output"))
    return Program(
        name=name
        or f"flash_attn_{b}x{hq}x{sq}x{skv}x{d}"
        + ("_causal" if causal else "")
        + (f"_gqa{g}" if g > 1 else "")
        + ("_mask" if mask is not None else "")
        + ("_bshd" if heads_last else "")
        + (f"_dv{dv}" if dv != d else "")
        + (f"_cap{softcap:g}" if softcap else "")
        + ("_sinks" if sinks else "")
        + ("_paged" if paged is not None else "")
        + (f"_of{kv_rows}" if kv_rows is not None and kv_rows != skv else ""),
        dims=dims,
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=l4,
    )


@persisted("flash")
def best_flash_attention(
    b: int,
    hq: int,
    hk: int,
    sq: int,
    skv: int,
    d: int,
    dtype: torch.dtype = torch.float16,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: tuple[tuple[int, int, int, int], torch.dtype] | None = None,
    heads_last: bool = False,
    dv: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    paged: PagedKV | None = None,
    kv_rows: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """The flash-attention program the timing model finds fastest: core
    splits (query heads of a group on one core, or on several with K/V
    multicast), query and key tiles that fit the LX, double buffered or not."""
    from torch_spyre.kernels.search import Search

    cfg = config or HardwareConfig()
    g = hq // hk if hk and hq % hk == 0 else 1
    # the cores left after batch and KV heads, shared between the query
    # heads of a group and the query positions in every proportion: heads
    # balance a causal triangle (each core the whole sequence), positions
    # keep a core's addresses inside its span (a heads-last output is
    # strided over the whole sequence), and a mix of both can do either
    pb, ph = _greedy_split((b, hk), cfg.cores)
    rest = cfg.cores // (pb * ph)
    splits = {
        (pb, ph, pg, max(1, min(sq, rest // pg)))
        for pg in range(1, min(g, rest) + 1)
        if rest % pg == 0
    }
    splits |= {
        _greedy_split((b, hk, g, sq), cfg.cores),
        _greedy_split((b, hk, sq, g), cfg.cores)[:2]
        + _greedy_split((b, hk, sq, g), cfg.cores)[3:]
        + _greedy_split((b, hk, sq, g), cfg.cores)[2:3],
    }
    # fewer cores on the batch than it could take, the rest on heads and
    # positions (batch 4 x 8 KV heads, causal: 2 x 8 x 2 balances the
    # triangle better than 4 x 8 with each core's whole sequence)
    # (tried after the others: a tie keeps the plan found before)
    fewer = set()
    for pb_ in (1 << i for i in range(cfg.cores.bit_length())):
        if pb_ < pb and b % pb_ == 0:
            for rest_dims in ((hk, g, sq), (hk, sq, g)):
                ph_, p2, p3 = _greedy_split(rest_dims, cfg.cores // pb_)
                fewer.add((pb_, ph_, p2, p3) if rest_dims[1] == g else (pb_, ph_, p3, p2))

    def build(c: tuple) -> Program:
        split, db, tq, tk, ob, th = c
        return flash_attention(
            b, hq, hk, sq, skv, d, dtype, causal=causal, scale=scale, mask=mask,
            split=split, tiles=(tq, tk), double_buffer=db, out_buffer=ob, head_tile=th,
            heads_last=heads_last, dv=dv, softcap=softcap, sinks=sinks,
            paged=paged, kv_rows=kv_rows, config=cfg, name=name,
        )  # fmt: skip

    found = Search(build, cfg, margin=1e-12, rejected=(ProgramError,))
    for split in sorted(splits) + sorted(fewer - splits):
        eq = ceil_div(sq, split[3])
        tqs = sorted({min(eq, t) for t in (64, 128, 256, 512, eq)})
        # a paged decode (one query) has the LX for longer K/V tiles
        tks = sorted({min(skv, t) for t in (64, 128, 256, *((512,) if paged else ()))})
        # a paged read: also every KV head of a core in one tile (a page's
        # heads in one transfer); tried after one a tile (a tie keeps that)
        ths = (1, ceil_div(hk, split[1])) if paged else (1,)
        for db in (True, False):
            tiles = itertools.product(tqs, tks, (True, False), sorted(set(ths)))
            found.run((split, db, tq, tk, ob, th) for tq, tk, ob, th in tiles)
            if found.best is not None:
                break  # single buffering only when nothing double buffered fits
    if found.best is None:
        raise ProgramError(
            f"flash attention {b}x{hq}x{sq}x{skv}x{d}: no tiling fits the LX "
            f"({cfg.lx_bytes} bytes per core)"
        )
    return found.best.result
