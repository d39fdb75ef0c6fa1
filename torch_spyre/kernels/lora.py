"""Multi-LoRA: the shrink and expand of one projection for a whole batch, one program.

Punica's SGMV (segmented gather matrix-vector) for the card.  The batch's
LoRA tokens are grouped by adapter slot (rows of slot 0, then slot 1, ...,
``counts[e]`` rows each; base-model tokens are left out by the producer,
``ops/lora.py``), and one grouped program (``ir.GroupedProgram``: phases
run one after another on all cores, one launch) computes, for every slice
``i`` of the projection (q, k and v of a fused QKV, gate and up of a merged
MLP projection) and every slot ``e`` with rows:

* **shrink** ``s_i[rows of e] = x[rows of e] @ A_i[e]^T``: the stacked
  ``A_i`` [L, 1, r, K] read in place at slot ``e``;
* **expand** ``out[rows of e, off_i : off_i + n_i] = s_i[rows of e] @ B_i[e]^T``:
  the stacked ``B_i`` [L, 1, n_i, r], written at the slice's columns.

All shrink phases come first, then all expand phases, so each ``s_i`` is
complete before it is read.  Each phase is the best plain matmul program for
its rows (templates cached per shape), so an adapter's weights are read once
per step however many of its tokens the batch holds, and a slot no token uses
costs nothing.  The adapters' scaling is folded into ``B`` by vLLM's loader.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from torch_spyre import kernels
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Buffer,
    GroupedProgram,
    Load,
    Operand,
    Program,
    ProgramError,
    Store,
    Vector,
    rebase,
)
from torch_spyre.layout import SpyreTensorLayout, stick_elems

I32 = torch.int32


@lru_cache(maxsize=512)
def _matmul_template(rows: int, k: int, n: int, dtype: torch.dtype, cfg: HardwareConfig) -> Program:
    return kernels.best_matmul(rows, n, k, dtype, config=cfg)


def _phases(counts: tuple[int, ...]):
    """(slot, first row, rows) of every slot with rows, in slot order."""
    row0 = 0
    for e, n in enumerate(counts):
        if n:
            yield e, row0, n
        row0 += n


def sgmv(
    counts: tuple[int, ...],
    k: int,
    rank: int,
    slices: tuple[int, ...],
    dtype: torch.dtype,
    *,
    out_rows: int,
    live: tuple[tuple[bool, ...], ...] | None = None,
    shrink: bool = True,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """Shrink and expand of every slice for the grouped LoRA rows, one launch.

    Operands: ``x`` [R, K] (rows grouped by slot), ``a{i}`` [L, 1, r, K] and
    ``b{i}`` [L, 1, n_i, r] (slice ``i``'s stacked weights, L = ``len(counts)``),
    ``s{i}`` [R, r] (the shrunk rows, scratch; R = ``sum(counts)``), ``out``
    [``out_rows``, sum(n_i)] (at least R rows; rows past R are not written).
    ``shrink=False``: expand only, ``x`` [R, r] already shrunk (the embedding's
    LoRA, whose ``A`` rows are gathered by token id), no ``a{i}`` nor ``s{i}``.
    ``live[i][e]`` as ``sgmv_indexed`` (None: every slot of every slice).
    """
    cfg = config or HardwareConfig()
    num = len(counts)
    r = sum(counts)
    if out_rows < r:
        raise ProgramError(f"lora sgmv: {r} grouped rows but {out_rows} rows of out")
    lay = SpyreTensorLayout.default
    n_total = sum(slices)
    x_l, out_l = lay((r, k), dtype), lay((out_rows, n_total), dtype)
    s_l = lay((r, rank), dtype)
    if not shrink and k != rank:
        raise ProgramError(f"lora expand: x has {k} columns, the rank is {rank}")
    shrinks, expand = [], []
    off = 0
    for i, n in enumerate(slices):
        a_l = lay((num, 1, rank, k), dtype)
        b_l = lay((num, 1, n, rank), dtype)
        for e, row0, rows in _phases(counts):
            if live is not None and not live[i][e]:
                continue
            if shrink:
                p = _matmul_template(rows, k, rank, dtype, cfg)
                p = rebase(p, "a", x_l, offsets=(row0, 0), rename="x")
                p = rebase(p, "b", a_l, lead=(e, 0), perm=(1, 0), rename=f"a{i}")
                p = rebase(p, "out", s_l, offsets=(row0, 0), rename=f"s{i}")
                shrinks.append(_named(p, f"shrink{i}_slot{e}_{rows}rows"))
            p = _matmul_template(rows, rank, n, dtype, cfg)
            src = f"s{i}" if shrink else "x"
            p = rebase(p, "a", s_l, offsets=(row0, 0), rename=src)
            p = rebase(p, "b", b_l, lead=(e, 0), perm=(1, 0), rename=f"b{i}")
            p = rebase(p, "out", out_l, offsets=(row0, off))
            expand.append(_named(p, f"expand{i}_slot{e}_{rows}rows"))
        off += n
    if not expand:
        raise ProgramError("lora sgmv: no slot has rows")
    kind = "sgmv" if shrink else "expand"
    return GroupedProgram(
        f"lora_{kind}_{len(expand) // len(slices)}of{num}_{k}x{rank}x"
        f"{'+'.join(map(str, slices))}_{r}rows",
        (*shrinks, *expand),
    )


def sgmv_indexed(
    counts: tuple[int, ...],
    k: int,
    rank: int,
    slices: tuple[int, ...],
    live: tuple[tuple[bool, ...], ...],
    dtype: torch.dtype,
    *,
    tokens: int,
    table_rows: int | None = None,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """``y[t] += x[t] @ A_i[e]^T @ B_i[e]^T`` for the LoRA tokens, one launch, no copies.

    As ``sgmv``, but the rows are not grouped beforehand: operand ``rows``
    [R, 1] int32 lists the LoRA tokens in slot order (``counts[e]`` of slot
    ``e``), and each phase gathers its tokens' rows of ``x`` [T, K] through
    it (one DMA descriptor per row, as paged attention reads its pages) and
    adds its deltas into the same rows of ``y`` [T, N] in place (load, add,
    store: rows of one phase are distinct, and phases run one after
    another).  ``live[i][e]``: slot ``e`` holds weights for slice ``i``; a
    dead (slice, slot) costs nothing.  ``s{i}`` [R, r] is scratch.  The
    slices' column offsets in ``y`` must be whole sticks.  ``table_rows``:
    the rows of the ``rows`` operand (a fixed buffer; at least R).
    """
    cfg = config or HardwareConfig()
    num = len(counts)
    r = sum(counts)
    lay = SpyreTensorLayout.default
    n_total = sum(slices)
    x_l, y_l = lay((tokens, k), dtype), lay((tokens, n_total), dtype)
    s_l, rows_l = lay((r, rank), dtype), lay((max(table_rows or r, r), 1), I32)
    shrinks, expands = [], []
    off = 0
    for i, n in enumerate(slices):
        if off % stick_elems(dtype):
            raise ProgramError(f"lora sgmv: slice {i} starts at column {off}, not a stick")
        a_l = lay((num, 1, rank, k), dtype)
        b_l = lay((num, 1, n, rank), dtype)
        for e, row0, rows in _phases(counts):
            if not live[i][e]:
                continue
            p = _gathered(_matmul_template(rows, k, rank, dtype, cfg), "a")
            p = rebase(p, "a", x_l, rename="x")
            p = rebase(p, "idx", rows_l, offsets=(row0, 0), rename="rows")
            p = rebase(p, "b", a_l, lead=(e, 0), perm=(1, 0), rename=f"a{i}")
            p = rebase(p, "out", s_l, offsets=(row0, 0), rename=f"s{i}")
            shrinks.append(_named(p, f"shrink{i}_slot{e}_{rows}rows"))
            p = _accumulated(_accumulate_template(rows, rank, n, dtype, cfg))
            p = rebase(p, "a", s_l, offsets=(row0, 0), rename=f"s{i}")
            p = rebase(p, "idx", rows_l, offsets=(row0, 0), rename="rows")
            p = rebase(p, "b", b_l, lead=(e, 0), perm=(1, 0), rename=f"b{i}")
            p = rebase(p, "out", y_l, offsets=(0, off), rename="y")
            expands.append(_named(p, f"expand{i}_slot{e}_{rows}rows"))
        off += n
    if not expands:
        raise ProgramError("lora sgmv: no live slot has rows")
    return GroupedProgram(
        f"lora_sgmv_{len(expands)}ph_{k}x{rank}x{'+'.join(map(str, slices))}_{r}of{tokens}rows",
        (*shrinks, *expands),
    )


@lru_cache(maxsize=512)
def _accumulate_template(
    rows: int, k: int, n: int, dtype: torch.dtype, cfg: HardwareConfig
) -> Program:
    """The fastest matmul of ``rows x k x n`` whose K is not split over cores
    (each output tile is then loaded, added to and stored by one core)."""
    from torch_spyre.kernels.basic import matmul
    from torch_spyre.kernels.search import search

    pows = [1 << j for j in range(cfg.cores.bit_length()) if 1 << j <= cfg.cores]
    se = stick_elems(dtype)
    splits = [
        (pm, pn, 1) for pm in pows for pn in pows if pm * pn <= cfg.cores and pm <= rows
        and pn <= -(-n // se)
    ]  # fmt: skip
    found = search(splits, lambda sp: matmul(rows, n, k, dtype, split=sp, config=cfg), cfg)
    return found.result


def _gathered(p: Program, operand: str) -> Program:
    """``p`` reading the rows of ``operand`` (dim ``m``) through the int32 row
    table ``idx`` [rows, 1] (loaded next to the operand's tiles)."""
    steps = []
    for st in p.steps:
        if isinstance(st, Load) and st.operand == operand:
            steps.append(Load("idx_t", "idx", ("m", None), st.loops))
            st = Load(**{**st.__dict__, "rows": "idx_t", "rows_dim": 0})
        steps.append(st)
    m = next(d for d in p.dims if d.name == "m")
    return Program(
        p.name,
        p.dims,
        (*p.operands, Operand("idx", SpyreTensorLayout.default((m.size, 1), I32), "input")),
        (*p.buffers, Buffer("idx_t", ("m",), I32)),
        tuple(steps),
        p.loop_order,
        dict(p.meta),
    )


def _accumulated(p: Program) -> Program:
    """``p`` adding its result into the rows of ``out`` named by the row table
    ``idx`` (``out[idx[m]] += acc[m]``: load, add, store)."""
    steps = []
    dtype = next(b.dtype for b in p.buffers if b.name == "b_t")
    for st in p.steps:
        if isinstance(st, Store) and st.operand == "out":
            steps += [
                Load("idx_t", "idx", ("m", None), st.loops),
                Load("old_t", "out", st.index, st.loops, rows="idx_t", rows_dim=0),
                Vector("add", st.buffer, (st.buffer, "old_t"), (), st.loops),
            ]
            st = Store(**{**st.__dict__, "rows": "idx_t", "rows_dim": 0})
        steps.append(st)
    m = next(d for d in p.dims if d.name == "m")
    return Program(
        p.name,
        p.dims,
        (*p.operands, Operand("idx", SpyreTensorLayout.default((m.size, 1), I32), "input")),
        (*p.buffers, Buffer("idx_t", ("m",), I32), Buffer("old_t", ("m", "n"), dtype)),
        tuple(steps),
        p.loop_order,
        dict(p.meta),
    )


def _named(p: Program, name: str) -> Program:
    return Program(name, p.dims, p.operands, p.buffers, p.steps, p.loop_order, dict(p.meta))
