"""Projections of one activation as one kernel program (``norm_projections``),
optionally behind the RMS norm that precedes them, and the split and tiles the
timing model finds fastest for it (``best_norm_projections``).  Used by the
eager and compiled op ``spyre::norm_projections`` (``ops/projections.py``):
an attention block's Q, K and V projections of the normed residual stream."""

from __future__ import annotations

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
    RingAllReduce,
    Store,
)
from torch_spyre.kernels.search import persisted
from torch_spyre.kernels.splits import double_if_it_fits, row_block_extents, row_block_plans
from torch_spyre.kernels.swiglu import norm_prologue
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


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
    """
    cfg = config or HardwareConfig()
    n = projection_block(widths, dtype)
    if n is None:
        raise ProgramError(f"projections of widths {widths}: no common block of whole sticks")
    pb, pm, pn, pk = split if split is not None else (1, min(m, cfg.cores), 1, 1)
    if not batched and (b != 1 or pb != 1):
        raise ProgramError("norm_projections: an unbatched x needs b == 1")
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
    for i, w in enumerate(widths):
        operands.append(Operand(f"w{i}", SpyreTensorLayout.default((w, k), dtype), "input"))
        for r in range(w // n):
            wt, at = f"w{i}t{r}", f"a{i}t{r}"
            steps += [
                Load(wt, f"w{i}", ("n", "k"), l4, multicast=w_mc, offsets=(r * n, 0)),
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
) -> Program:
    """The projections program the timing model finds fastest: core splits
    over (batch, rows, column block, k) and tiles that fit the LX and a
    core's address span (``splits.row_block_plans``, as the SwiGLU MLP's)."""
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
                tb=tb, batched=batched, double_acc=dacc, config=cfg, name=name,
            )  # fmt: skip

        return double_if_it_fits(program, cfg)

    found = Search(build, cfg, margin=1e-12, rejected=(ProgramError,))
    plans = row_block_plans(
        b, m, k, n, cfg.cores, stick_elems(dtype), batched=batched, k_split=True
    )
    for split, tiles in plans:
        found.run((split, t) for t in tiles)
    if found.best is None:
        raise ProgramError(f"projections {b * m}x{k}x{sum(widths)}: no plan fits the card")
    return found.best.result
