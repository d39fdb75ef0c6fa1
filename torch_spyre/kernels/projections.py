"""Projections of one activation as one kernel program (``norm_projections``),
optionally behind the RMS norm that precedes them, and the split and tiles the
timing model finds fastest for it (``best_norm_projections``).  Used by the
eager and compiled op ``spyre::norm_projections`` (``ops/projections.py``):
an attention block's Q, K and V projections of the normed residual stream."""

from __future__ import annotations

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
    RingAllReduce,
    Store,
    Vector,
)
from torch_spyre.kernels.search import persisted
from torch_spyre.kernels.splits import double_if_it_fits, row_block_extents, row_block_plans
from torch_spyre.kernels.swiglu import norm_prologue
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


@dataclass(frozen=True)
class Heads:
    """The outputs as attention heads of ``dim`` elements (``x @ w.T`` viewed
    as [b, m, heads, dim]), each head's two halves along a dim ``j`` of two.

    ``rope[i]``: output ``i`` is rotated as transformers'
    ``apply_rotary_pos_emb`` does, ``o * cos + rotate_half(o) * sin``
    (``rotate_half(o) = cat(-o[..., dim/2:], o[..., :dim/2])``), by the
    operands ``cos`` and ``sin`` [cos_batch, m, dim]: with the halves along
    ``j`` the rotation is a ``rotate_half`` vector step moving whole sticks,
    two products and a sum on the vector units, in the epilogue, before the
    store (no lane shuffle, no pass over device memory).  ``first[i]``: output ``i`` is stored
    heads-first, [b, heads, m, dim] (what ``view(b, m, heads, dim)
    .transpose(1, 2).contiguous()`` gives: the layout attention reads),
    else token-major [b, m, heads * dim].  A half must be whole sticks.

    ``norm[i]``: output ``i``'s heads are RMS-normed before the rotation, as
    Qwen3's ``q_norm``/``k_norm`` do (``LlamaRMSNorm`` over each head's
    ``dim`` elements, epsilon ``norm_eps``, weight operand ``hn{i}``
    [dim]): each head's sum of squares (over its halves' sticks, then the
    two halves), ``rsqrt(mean + eps)``, times the weight, in the epilogue."""

    dim: int
    rope: tuple[bool, ...]
    first: tuple[bool, ...]
    cos_batch: int = 1
    norm: tuple[bool, ...] = ()
    norm_eps: float = 0.0
    #: outputs stored heads-first into a KV cache of ``cache_len`` rows
    #: (operand ``out{i}`` [b, heads, cache_len, dim]) at the rows operand
    #: ``pos`` [m] (int32) names, instead of an output of their own (a
    #: negative row is not written); ``cache_run``: rows a DMA descriptor
    #: writes (the caller's promise that each tile's rows are that many
    #: consecutive cache rows: a prefill's positions; else 1)
    cached: tuple[bool, ...] = ()
    cache_len: int = 0
    cache_run: int = 1

    def normed(self, i: int) -> bool:
        return bool(self.norm) and self.norm[i]

    def into_cache(self, i: int) -> bool:
        return bool(self.cached) and self.cached[i]


def projection_block(widths: tuple[int, ...], dtype: torch.dtype) -> int | None:
    """The column block ``n`` every width is a whole multiple of (the
    narrowest width; Q's width is the group size times K's and V's), in whole
    sticks; None when the widths do not share one."""
    n = min(widths)
    if n % stick_elems(dtype) or any(w % n for w in widths):
        return None
    return n


def norm_projections(
    b: int,
    m: int,
    k: int,
    widths: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
    *,
    norm_eps: float | None = None,
    split: tuple[int, int, int, int] | None = None,
    tiles: tuple[int, int, int] | None = None,
    tb: int = 1,
    batched: bool = True,
    double_acc: bool = False,
    config: HardwareConfig | None = None,
    name: str | None = None,
    heads: Heads | None = None,
    merged: bool = False,
) -> Program:
    """``out_i = x @ w_i^T`` for every weight ``w_i`` [widths[i], k], the
    activation read once.

    Each core keeps its block of activation rows in LX (its whole k, or its
    band of k sticks when k is split over cores) while the weights stream
    past it.  The weights are cut into column blocks of ``n`` (the narrowest
    width): weight ``i`` is ``widths[i] // n`` row blocks, read in place
    through row offsets, each with its own fp32 accumulator, and every block
    walks the same ``n`` loop, so one loop nest streams all of them (Q's 4
    blocks and K's and V's 1 each for 4 query heads per KV head).  Weight
    tiles shared by the cores splitting rows are read once per group and
    multicast over the ring; with k split over cores the partial sums are
    combined by a ring all-reduce before the store.

    ``norm_eps=eps``: ``x`` is the residual stream and the activation is
    transformers' ``LlamaRMSNorm`` of it, computed in LX (operand ``nw`` [k],
    ``kernels.swiglu.norm_prologue``): the normed rows never reach device
    memory.

    Operands: ``x`` [b, m, k] (``batched=False``: [m, k]), ``w0``, ``w1``, ...,
    ``out0``, ``out1``, ... [b, m, widths[i]].  ``split``: cores over (b, m, n,
    k); ``tiles``: (tm, tn, tk); ``tb``: batch elements per tile.
    ``double_acc``: the fp32 accumulators are double buffered, so the stores
    of one column block overlap the next block's weight stream instead of
    stalling it (twice their LX).

    ``merged``: the weights are the consecutive row blocks of one operand
    ``w`` [sum(widths), k] (vLLM's merged ``qkv_proj``), read in place
    through row offsets, instead of operands ``w0``, ``w1``, ...

    ``heads``: the outputs as attention heads (``Heads``): the column dim
    ``n`` counts the heads of a block (``tiles``' ``tn`` too), ``j`` the two
    halves of a head and ``e`` a half's elements (operand ``w_i`` [widths[i]
    / dim, 2, dim / 2, k], the bytes of [widths[i], k]), so a head norm, RoPE
    and a heads-first store are epilogues of the tile.
    """
    cfg = config or HardwareConfig()
    n = projection_block(widths, dtype)
    if n is None:
        raise ProgramError(f"projections of widths {widths}: no common block of whole sticks")
    pb, pm, pn, pk = split if split is not None else (1, min(m, cfg.cores), 1, 1)
    if not batched and (b != 1 or pb != 1):
        raise ProgramError("norm_projections: an unbatched x needs b == 1")
    if heads is not None:
        return _head_projections(
            b, m, k, widths, dtype, heads, norm_eps=norm_eps, split=(pb, pm, pn, pk),
            tiles=tiles, tb=tb, batched=batched, double_acc=double_acc, name=name, merged=merged,
        )  # fmt: skip
    pn, pk, en, ek, em, (tm, tn, tk) = row_block_extents(
        m, n, k, pm, pn, pk, stick_elems(dtype), tiles
    )
    acc = torch.float32 if dtype.is_floating_point else torch.int32
    dims = [
        Dim("b", b, pb, tb),
        Dim("m", m, pm, tm),
        Dim("n", n, pn, tn, chunk=en if pn > 1 else None),
        Dim("k", k, pk, tk, chunk=ek if pk > 1 else None),
    ]
    rows = ("b", "m") if batched else ("m",)
    l2 = rows
    l3 = (*rows, "n")
    l4 = (*rows, "n", "k")
    w_mc = pb * pm > 1
    steps: list = [Load("xt", "x", (*rows, "k"), l2, multicast=pn > 1)]
    steps += norm_prologue(norm_eps, k, pk > 1, l2, "xt")
    buffers = [Buffer("xt", (*rows, "k"), dtype, tm < em or tb < ceil_div(b, pb))]
    stores = []
    operands = [
        Operand("x", SpyreTensorLayout.default((b, m, k) if batched else (m, k), dtype), "input")
    ]
    if merged:
        operands.append(Operand("w", SpyreTensorLayout.default((sum(widths), k), dtype), "input"))
    for i, w in enumerate(widths):
        if not merged:
            operands.append(Operand(f"w{i}", SpyreTensorLayout.default((w, k), dtype), "input"))
        src, base = ("w", sum(widths[:i])) if merged else (f"w{i}", 0)
        for r in range(w // n):
            wt, at = f"w{i}t{r}", f"a{i}t{r}"
            steps += [
                Load(wt, src, ("n", "k"), l4, multicast=w_mc, offsets=(base + r * n, 0)),
                Matmul(at, "xt", wt, l4),
            ]
            buffers += [
                Buffer(wt, ("n", "k"), dtype, True),
                Buffer(at, (*rows, "n"), acc, double_acc),
            ]
            if pk > 1:
                stores.append(RingAllReduce(at, "k", "sum", l3))
            at_col = (0, 0, r * n) if batched else (0, r * n)
            stores.append(Store(f"out{i}", at, (*rows, "n"), l3, offsets=at_col))
    steps += stores
    for i, w in enumerate(widths):
        shape = (b, m, w) if batched else (m, w)
        operands.append(Operand(f"out{i}", SpyreTensorLayout.default(shape, dtype), "output"))
    if norm_eps is not None:
        operands.append(Operand("nw", SpyreTensorLayout.default((k,), dtype), "input"))
        buffers += [Buffer("rs", rows, acc), Buffer("nwt", ("k",), dtype)]
    if not batched:
        dims = [d for d in dims if d.name != "b"]
    return Program(
        name=name
        or f"projections_{b * m}x{k}x{'_'.join(map(str, widths))}"
        + ("_norm" if norm_eps is not None else ""),
        dims=tuple(dims),
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=l4,
    )


def _weight_as_heads(w: int, hd: int, k: int, dtype: torch.dtype) -> SpyreTensorLayout:
    """A weight [w, k] in its default layout ([k sticks, w, stick]) as
    [w / hd, 2, hd / 2, k]: its rows split into heads and halves, the same bytes."""
    se = stick_elems(dtype)
    return SpyreTensorLayout(
        (w // hd, 2, hd // 2, k), (ceil_div(k, se), w // hd, 2, hd // 2, se), (3, 0, 1, 2, 3), dtype
    )


def _head_projections(
    b: int,
    m: int,
    k: int,
    widths: tuple[int, ...],
    dtype: torch.dtype,
    heads: Heads,
    *,
    norm_eps: float | None,
    split: tuple[int, int, int, int],
    tiles: tuple[int, int, int] | None,
    tb: int,
    batched: bool,
    double_acc: bool,
    name: str | None,
    merged: bool = False,
) -> Program:
    """``norm_projections`` with ``heads``: see there."""
    se = stick_elems(dtype)
    hd, half = heads.dim, heads.dim // 2
    nw_ = len(widths)
    if hd % 2 or half % se or any(w % hd for w in widths):
        raise ProgramError(
            f"projections as heads of {hd}: half a head must be whole sticks of {se} "
            f"and every width ({widths}) whole heads"
        )
    if len(heads.rope) != nw_ or len(heads.first) != nw_ or len(heads.norm) not in (0, nw_):
        raise ProgramError(
            f"projections as heads: one rope, layout and norm flag per weight ({nw_})"
        )
    if any(heads.first) and not batched:
        raise ProgramError("projections stored heads-first need a batched x [b, m, k]")
    if heads.cached and (
        len(heads.cached) != nw_
        or any(c and not f for c, f in zip(heads.cached, heads.first))
        or heads.cache_len < 1
        or heads.cache_run < 1
    ):
        raise ProgramError(
            "projections into a KV cache: one flag per weight, each cached output heads-first, "
            "a cache of at least one row and runs of at least one row"
        )
    if heads.cos_batch not in (1, b):
        raise ProgramError(f"rotary tables of batch {heads.cos_batch} for a batch of {b}")
    nh = projection_block(widths, dtype) // hd  # heads per column block
    pb, pm, pn, pk = split
    pn, pk, en, ek, em, (tm, tn, tk) = row_block_extents(
        m, nh, k, pm, pn, pk, se, tiles if tiles is not None else (ceil_div(m, pm), 1, 512), 1
    )
    acc = torch.float32 if dtype.is_floating_point else torch.int32
    dims = [
        Dim("b", b, pb, tb),
        Dim("m", m, pm, tm),
        Dim("n", nh, pn, tn, chunk=en if pn > 1 else None),
        Dim("j", 2),  # a head's halves
        Dim("e", half),
        Dim("k", k, pk, tk, chunk=ek if pk > 1 else None),
    ]
    rows = ("b", "m") if batched else ("m",)
    l2, l3, l4 = rows, (*rows, "n"), (*rows, "n", "k")
    tile = (*rows, "n", "j", "e")
    w_mc = pb * pm > 1
    steps: list = [Load("xt", "x", (*rows, "k"), l2, multicast=pn > 1)]
    steps += norm_prologue(norm_eps, k, pk > 1, l2, "xt")
    buffers = [Buffer("xt", (*rows, "k"), dtype, tm < em or tb < ceil_div(b, pb))]
    operands = [
        Operand("x", SpyreTensorLayout.default((b, m, k) if batched else (m, k), dtype), "input")
    ]
    if any(heads.rope):
        # the tables, loaded once per row tile
        cb = heads.cos_batch
        tshape = (cb, m, 2, half) if batched else (m, 2, half)
        tidx = ("b" if cb > 1 else None, "m", "j", "e") if batched else ("m", "j", "e")
        tdims = tuple(d for d in tidx if d is not None)
        for t in ("cos", "sin"):
            operands.append(Operand(t, SpyreTensorLayout.default(tshape, dtype), "input"))
            steps.append(Load(t, t, tidx, l2))
            buffers.append(Buffer(t, tdims, dtype))
        buffers.append(Buffer("rot", tile, acc))
    if any(heads.norm):
        buffers += [Buffer("hss", (*rows, "n", "j"), acc), Buffer("hs", (*rows, "n"), acc)]
    if any(heads.cached):
        # each token's cache row, loaded once per row tile
        operands.append(Operand("pos", SpyreTensorLayout.default((m,), torch.int32), "input"))
        steps.append(Load("pos", "pos", ("m",), l2))
        buffers.append(Buffer("pos", ("m",), torch.int32))
    epilogue: list = []
    if merged:
        operands.append(Operand("w", _weight_as_heads(sum(widths), hd, k, dtype), "input"))
    for i, w in enumerate(widths):
        if not merged:
            operands.append(Operand(f"w{i}", _weight_as_heads(w, hd, k, dtype), "input"))
        src, base = ("w", sum(widths[:i]) // hd) if merged else (f"w{i}", 0)
        for r in range(w // (nh * hd)):
            wt, at = f"w{i}t{r}", f"a{i}t{r}"
            steps += [
                Load(wt, src, ("n", "j", "e", "k"), l4, multicast=w_mc,
                     offsets=(base + r * nh, 0, 0, 0)),
                Matmul(at, "xt", wt, l4),
            ]  # fmt: skip
            buffers += [
                Buffer(wt, ("n", "j", "e", "k"), dtype, True),
                Buffer(at, tile, acc, double_acc),
            ]
            if pk > 1:
                epilogue.append(RingAllReduce(at, "k", "sum", l3))
            if heads.normed(i):
                if r == 0:
                    steps.append(Load(f"hn{i}t", f"hn{i}", ("j", "e"), l2))
                    buffers.append(Buffer(f"hn{i}t", ("j", "e"), dtype))
                epilogue += [
                    Reduce("sumsq", "hss", at, "e", l3),
                    Reduce("sum", "hs", "hss", "j", l3),
                    Vector("mul_scalar", "hs", ("hs",), (1.0 / hd,), l3),
                    Vector("add_scalar", "hs", ("hs",), (float(heads.norm_eps),), l3),
                    Vector("rsqrt", "hs", ("hs",), (), l3),
                    Vector("mul", at, (at, "hs"), (), l3),
                    Vector("mul", at, (at, f"hn{i}t"), (), l3),
                ]
            if heads.rope[i]:
                epilogue += [
                    Vector("rotate_half", "rot", (at,), (), l3, dim="j"),
                    Vector("mul", "rot", ("rot", "sin"), (), l3),
                    Vector("mul", at, (at, "cos"), (), l3),
                    Vector("add", at, (at, "rot"), (), l3),
                ]
            if heads.first[i]:
                idx: tuple[str, ...] = ("b", "n", "m", "j", "e")
                off: tuple[int, ...] = (0, r * nh, 0, 0, 0)
            elif batched:
                idx, off = ("b", "m", "n", "j", "e"), (0, 0, r * nh, 0, 0)
            else:
                idx, off = ("m", "n", "j", "e"), (0, r * nh, 0, 0)
            if heads.into_cache(i):  # the rows scattered to the tokens' cache rows
                epilogue.append(
                    Store(f"out{i}", at, idx, l3, offsets=off, rows="pos", rows_dim=2,
                          rows_run=heads.cache_run)
                )  # fmt: skip
            else:
                epilogue.append(Store(f"out{i}", at, idx, l3, offsets=off))
    steps += epilogue
    for i, w in enumerate(widths):
        if heads.first[i]:
            rows_of = heads.cache_len if heads.into_cache(i) else m
            shape: tuple[int, ...] = (b, w // hd, rows_of, 2, half)
        else:
            shape = (b, m, w // hd, 2, half) if batched else (m, w // hd, 2, half)
        operands.append(Operand(f"out{i}", SpyreTensorLayout.default(shape, dtype), "output"))
    if norm_eps is not None:
        operands.append(Operand("nw", SpyreTensorLayout.default((k,), dtype), "input"))
        buffers += [Buffer("rs", rows, acc), Buffer("nwt", ("k",), dtype)]
    for i in range(nw_):
        if heads.normed(i):
            # [dim] in its default layout ([dim sticks, stick]) as [2, dim / 2]
            lay = SpyreTensorLayout((2, half), (2, half // se, se), (0, 1, 1), dtype)
            operands.append(Operand(f"hn{i}", lay, "input"))
    if not batched:
        dims = [d for d in dims if d.name != "b"]
    return Program(
        name=name
        or f"projections_{b * m}x{k}x{'_'.join(map(str, widths))}"
        + ("_norm" if norm_eps is not None else "")
        + ("_qknorm" if any(heads.norm) else "")
        + ("_rope" if any(heads.rope) else "")
        + ("_bhsd" if any(heads.first) else "")
        + ("_cache" if any(heads.cached) else ""),
        dims=tuple(dims),
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=l4,
    )


@persisted("projections")
def best_norm_projections(
    b: int,
    m: int,
    k: int,
    widths: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
    *,
    norm_eps: float | None = None,
    batched: bool = True,
    config: HardwareConfig | None = None,
    name: str | None = None,
    heads: Heads | None = None,
    merged: bool = False,
) -> Program:
    """The projections program the timing model finds fastest: core splits
    over (batch, rows, column block, k) and tiles that fit the LX and a
    core's address span (``splits.row_block_plans``, as the SwiGLU MLP's);
    with ``heads``, the column block split and tiled in whole heads."""
    from torch_spyre.kernels.search import Search

    cfg = config or HardwareConfig()
    n = projection_block(widths, dtype)
    if n is None:
        raise ProgramError(f"projections of widths {widths}: no common block of whole sticks")

    def build(c: tuple) -> Program:
        split, (tb, tm, tn, tk) = c

        def program(dacc: bool) -> Program:
            return norm_projections(
                b, m, k, widths, dtype, norm_eps=norm_eps, split=split, tiles=(tm, tn, tk),
                tb=tb, batched=batched, double_acc=dacc, config=cfg, name=name, heads=heads,
                merged=merged,
            )  # fmt: skip

        return double_if_it_fits(program, cfg)

    found = Search(build, cfg, margin=1e-12, rejected=(ProgramError,))
    se = stick_elems(dtype)
    if heads is None:
        plans = row_block_plans(b, m, k, n, cfg.cores, se, batched=batched, k_split=True)
    else:  # the block's heads over cores, one or two heads a tile
        nh = n // heads.dim if n % heads.dim == 0 else 0
        if not nh:
            raise ProgramError(f"projections of widths {widths}: no block of whole heads")
        plans = row_block_plans(
            b, m, k, nh, cfg.cores, se, batched=batched, k_split=True, n_unit=1, n_tiles=(1, 2),
            k_tiles=(128, 256, 512, 1024),
        )  # fmt: skip
    for split, tiles in plans:
        found.run((split, t) for t in tiles)
    if found.best is None:
        raise ProgramError(f"projections {b * m}x{k}x{sum(widths)}: no plan fits the card")
    return found.best.result
