"""Mixture-of-experts kernels: the experts of a layer as one grouped program.

Tokens are first grouped by expert (rows of expert 0, then expert 1, ...,
``counts[e]`` rows each) by the eager producer (``ops/moe.py``); the grouped
program then runs one phase per expert that received tokens
(``sim.grouped``):

* ``grouped_swiglu``: ``y_g = (act(x_g @ Wg[e]^T) * (x_g @ Wu[e]^T)) @ Wd[e]^T``
  scaled by each row's routing weight: the fused SwiGLU program of
  ``kernels.best_swiglu_mlp`` for the expert's rows, reading the expert's
  slices of the stacked weights in place (``W13 [E, 2I, H]``: the gate rows
  ``0..I``, the up rows ``I..2I``; ``W2 [E, H, I]``) and its rows of the
  grouped activations, writing its rows of the grouped output;
* ``grouped_matmul``: ``y_g = x_g @ W[e]`` (``torch._grouped_mm``), each
  phase the best plain matmul program of the expert's rows.

Each phase's core split and tiles are those the timing model picks for the
expert's row count (templates cached per row count), so a decode step (one
row per active expert) streams each active expert's weights over all cores,
and a prefill phase with many rows splits rows and hidden units.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from torch_spyre import kernels
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    GroupedProgram,
    Program,
    ProgramError,
    Vector,
    rebase,
    scale_rows_before_store,
)
from torch_spyre.layout import SpyreTensorLayout


@lru_cache(maxsize=256)
def _swiglu_template(rows: int, h: int, i: int, dtype: torch.dtype, cfg: HardwareConfig) -> Program:
    return kernels.best_swiglu_mlp(1, rows, h, i, h, dtype, batched=False, config=cfg)


@lru_cache(maxsize=512)
def matmul_template(rows: int, k: int, n: int, dtype: torch.dtype, cfg: HardwareConfig) -> Program:
    """The searched matmul of one group's rows (a grouped program's phase)."""
    return kernels.best_matmul(rows, n, k, dtype, config=cfg)


def group_phases(counts: tuple[int, ...]):
    """(group, first row, rows) of every group with rows, in group order
    (an expert's tokens here, an adapter slot's in kernels/lora.py)."""
    row0 = 0
    for e, n in enumerate(counts):
        if n:
            yield e, row0, n
        row0 += n


def grouped_swiglu(
    counts: tuple[int, ...],
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    *,
    act: str = "silu",
    rows_total: int | None = None,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """The experts of a SwiGLU mixture-of-experts layer, one phase per active expert.

    Operands: ``x`` [R, H] (rows grouped by expert), ``wg`` and ``wu`` (both the
    stacked gate/up weights [E, 2I, H], bound to the same tensor), ``wd`` [E, H, I],
    ``rw`` [R, 1] fp32 (each row's routing weight), ``out`` [R, H] (R = ``rows_total``,
    at least ``sum(counts)``; rows past the counts are not written).
    """
    cfg = config or HardwareConfig()
    num = len(counts)
    r = rows_total if rows_total is not None else sum(counts)
    if r < sum(counts):
        raise ProgramError(f"grouped experts: {sum(counts)} routed rows but {r} rows of x")
    lay = SpyreTensorLayout.default
    x_l, out_l = lay((r, hidden), dtype), lay((r, hidden), dtype)
    w13_l, w2_l = lay((num, 2 * inter, hidden), dtype), lay((num, hidden, inter), dtype)
    rw_l = lay((r, 1), torch.float32)  # routers normalise their weights in fp32
    phases = []
    for e, row0, n in group_phases(counts):
        p = _swiglu_template(n, hidden, inter, dtype, cfg)
        if act != "silu":
            p = _with_activation(p, act)
        p = rebase(p, "x", x_l, offsets=(row0, 0))
        p = rebase(p, "wg", w13_l, lead=(e,))
        p = rebase(p, "wu", w13_l, lead=(e,), offsets=(inter, 0))
        p = rebase(p, "wd", w2_l, lead=(e,))
        p = rebase(p, "out", out_l, offsets=(row0, 0))
        p = scale_rows_before_store(p, "out", "rw", "m", rw_l, row0)
        phases.append(_named(p, f"expert{e}_{n}rows"))
    if not phases:
        raise ProgramError("grouped experts: no expert received a token")
    return GroupedProgram(
        f"moe_swiglu_{len(phases)}of{num}x{hidden}x{inter}_{sum(counts)}rows", tuple(phases)
    )


def grouped_matmul(
    counts: tuple[int, ...],
    k: int,
    n: int,
    dtype: torch.dtype,
    *,
    weight_nk: bool,
    rows_total: int | None = None,
    config: HardwareConfig | None = None,
    n_chunk: int | None = None,
) -> GroupedProgram:
    """``out[rows of g] = a[rows of g] @ W[g]`` (``torch._grouped_mm``), one phase per group.

    Operands ``a`` [R, K], ``b`` the stacked weights ([E, N, K] when
    ``weight_nk``: a transposed view of it is what transformers passes, else
    [E, K, N]), ``out`` [R, N].  ``n_chunk``: one phase per group and block of
    that many output columns (the stacked layout interleaves the experts
    inside each row of sticks, so a phase over all N columns of a large
    expert can address more than a core's 256 MiB span: ops/moe.py retries
    with smaller blocks when the card rejects the program).
    """
    cfg = config or HardwareConfig()
    num = len(counts)
    r = rows_total if rows_total is not None else sum(counts)
    lay = SpyreTensorLayout.default
    a_l, out_l = lay((r, k), dtype), lay((r, n), dtype)
    b_l = lay((num, n, k) if weight_nk else (num, k, n), dtype)
    phases = []
    nc = min(n_chunk or n, n)
    for e, row0, rows in group_phases(counts):
        for n0 in range(0, n, nc):
            cols = min(nc, n - n0)
            p = matmul_template(rows, k, cols, dtype, cfg)
            p = rebase(p, "a", a_l, offsets=(row0, 0))
            p = rebase(p, "b", b_l, lead=(e,), offsets=(0, n0), perm=(1, 0) if weight_nk else None)
            p = rebase(p, "out", out_l, offsets=(row0, n0))
            tag = f"group{e}_{rows}rows" + (f"_cols{n0}" if nc < n else "")
            phases.append(_named(p, tag))
    if not phases:
        raise ProgramError("grouped matmul: every group is empty")
    return GroupedProgram(
        f"grouped_mm_{len(phases)}of{num}x{k}x{n}_{sum(counts)}rows"
        + (f"_by{nc}cols" if nc < n else ""),
        tuple(phases),
    )


def _named(p: Program, name: str) -> Program:
    return Program(name, p.dims, p.operands, p.buffers, p.steps, p.loop_order, dict(p.meta))


def _with_activation(p: Program, act: str) -> Program:
    from torch_spyre.ir import vector_ops as sim_ops

    if act not in sim_ops.VECTOR_OPS:
        raise ProgramError(f"grouped experts: no vector op for the activation {act!r}")
    steps = tuple(
        Vector(act, s.out, s.inputs, s.scalars, s.loops)
        if isinstance(s, Vector) and s.op == "silu"
        else s
        for s in p.steps
    )
    return Program(p.name, p.dims, p.operands, p.buffers, steps, p.loop_order, dict(p.meta))
