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
from torch_spyre.ir import GroupedProgram, Program, ProgramError, rebase
from torch_spyre.layout import SpyreTensorLayout


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


def _named(p: Program, name: str) -> Program:
    return Program(name, p.dims, p.operands, p.buffers, p.steps, p.loop_order, dict(p.meta))
