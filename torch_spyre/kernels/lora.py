"""Multi-LoRA: the shrink and expand of one projection for a whole batch, one program.

Punica's SGMV (segmented gather matrix-vector) for the card.  The batch's
LoRA tokens are listed in adapter-slot order (``counts[e]`` tokens of slot
``e``; base-model tokens are left out by the producer, ``ops/lora.py``), and
one grouped program (``ir.GroupedProgram``: phases run one after another on
all cores, one launch) computes, for every slice ``i`` of the projection (q,
k and v of a fused QKV, gate and up of a merged MLP projection) and every
slot ``e`` with tokens that holds weights for the slice:

* **shrink** ``s_i[rows of e] = x[tokens of e] @ A_i[e]^T``: the stacked
  ``A_i`` [L, 1, r, K] read in place at slot ``e``;
* **expand** ``y[tokens of e, off_i : off_i + n_i] += s_i[rows of e] @ B_i[e]^T``:
  the stacked ``B_i`` [L, 1, n_i, r], added into the output in place.

``sgmv_indexed`` reads the tokens' rows of ``x`` and ``y`` through an int32
row table (``Load.rows`` / ``Store.rows``: one DMA descriptor per row, as paged
attention reads its pages), so the whole projection is this one launch.
``sgmv`` is the form over rows grouped beforehand (its producer gathers them
and adds the deltas back), for what the indexed form cannot express.  All
shrink phases come first, then all expand phases, so each ``s_i`` is complete
before it is read.  Each phase is the best plain matmul program for its rows
(templates cached per shape), so an adapter's weights are read once per step
however many of its tokens the batch holds, and a slot no token uses costs
nothing.  The adapters' scaling is folded into ``B`` by vLLM's loader.
"""

from __future__ import annotations

from functools import lru_cache

import torch

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
from torch_spyre.kernels.moe import group_phases, matmul_template
from torch_spyre.kernels.waves import in_waves
from torch_spyre.layout import SpyreTensorLayout, stick_elems

I32 = torch.int32


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
    bt: bool = False,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """Shrink and expand of every slice for the grouped LoRA rows, one launch.

    Operands: ``x`` [R, K] (rows grouped by slot), ``a{i}`` [L, 1, r, K] and
    ``b{i}`` [L, 1, n_i, r] (slice ``i``'s stacked weights, L = ``len(counts)``),
    ``s{i}`` [R, r] (the shrunk rows, scratch; R = ``sum(counts)``), ``out``
    [``out_rows``, sum(n_i)] (at least R rows; rows past R are not written).
    ``shrink=False``: expand only, ``x`` [R, r] already shrunk (the embedding's
    LoRA, whose ``A`` rows are gathered by token id), no ``a{i}`` nor ``s{i}``.
    ``live[i][e]`` as ``sgmv_indexed`` (None: every slot of every slice);
    ``bt`` as ``sgmv_indexed``.
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
    shrinks, expands = [], []
    off = 0
    for i, n in enumerate(slices):
        a_l = lay((num, 1, rank, k), dtype)
        b_l, b_perm = _b_stack(num, n, rank, dtype, bt)
        for e, row0, rows in group_phases(counts):
            if live is not None and not live[i][e]:
                continue
            if shrink:

                def shrink_phase(c, i=i, e=e, row0=row0, rows=rows, a_l=a_l):
                    p = matmul_template(rows, k, rank, dtype, c)
                    p = rebase(p, "a", x_l, offsets=(row0, 0), rename="x")
                    p = rebase(p, "b", a_l, lead=(e, 0), perm=(1, 0), rename=f"a{i}")
                    p = rebase(p, "out", s_l, offsets=(row0, 0), rename=f"s{i}")
                    return _named(p, f"shrink{i}_slot{e}_{rows}rows")

                shrinks.append(shrink_phase)

            def expand_phase(c, i=i, e=e, row0=row0, rows=rows, n=n, off=off, b=(b_l, b_perm)):
                p = matmul_template(rows, rank, n, dtype, c)
                p = rebase(p, "a", s_l, offsets=(row0, 0), rename=f"s{i}" if shrink else "x")
                p = rebase(p, "b", b[0], lead=(e, 0), perm=b[1], rename=f"b{i}")
                p = rebase(p, "out", out_l, offsets=(row0, off))
                return _named(p, f"expand{i}_slot{e}_{rows}rows")

            expands.append((e, expand_phase))
        off += n
    if not expands:
        raise ProgramError("lora sgmv: no slot has rows")
    kind = "sgmv" if shrink else "expand"
    return in_waves(
        f"lora_{kind}_{len(expands) // len(slices)}of{num}_{k}x{rank}x"
        f"{'+'.join(map(str, slices))}_{r}rows",
        [shrinks, _slot_major(expands)],
        cfg,
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
    starts: tuple[int | None, ...] | None = None,
    table_rows: int | None = None,
    bt: bool = False,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """``y[t] += x[t] @ A_i[e]^T @ B_i[e]^T`` for the LoRA tokens, one launch, no copies.

    As ``sgmv``, but the rows are not grouped beforehand: operand ``rows``
    [R, 1] int32 lists the LoRA tokens in slot order (``counts[e]`` of slot
    ``e``).  A slot whose tokens are one run ``starts[e] ..`` of ``x`` [T, K]
    and ``y`` [T, N] (a prefill, adjacent decodes) reads and writes that block
    directly; any other slot's phases gather its rows of ``x`` through the
    table (one DMA descriptor per row, as paged attention reads its pages)
    and add into the same rows of ``y`` (load, add, store: rows of one phase
    are distinct, and phases run one after another).  ``live[i][e]``: slot
    ``e`` holds weights for slice ``i``; a dead (slice, slot) costs nothing.
    ``s{i}`` [R, r] is scratch.  The slices' column offsets in ``y`` must be
    whole sticks.  ``table_rows``: the rows of the ``rows`` operand (a fixed
    buffer; at least R).  ``bt``: each ``b{i}`` is stored transposed, [L, 1, r,
    n_i] (vLLM's [L, 1, n_i, r] stack as a transposed view of it): the stick
    dim is then the slice's columns, where [.., n_i, r] pads a rank under a
    stick (16 of 64 fp16 values) to a whole stick, reading 4x the bytes.
    """
    cfg = config or HardwareConfig()
    num = len(counts)
    r = sum(counts)
    starts = starts or (None,) * num
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
        b_l, b_perm = _b_stack(num, n, rank, dtype, bt)
        for e, row0, rows in group_phases(counts):
            if not live[i][e]:
                continue
            t0 = starts[e]
            gather = t0 is None
            at = (0 if gather else t0, 0)

            def shrink_phase(c, i=i, e=e, row0=row0, rows=rows, gather=gather, at=at, a_l=a_l):
                p = _shrink_template(rows, k, rank, dtype, gather, c)
                p = rebase(p, "a", x_l, offsets=at, rename="x")
                if gather:
                    p = rebase(p, "idx", rows_l, offsets=(row0, 0), rename="rows")
                p = rebase(p, "b", a_l, lead=(e, 0), perm=(1, 0), rename=f"a{i}")
                p = rebase(p, "out", s_l, offsets=(row0, 0), rename=f"s{i}")
                return _named(p, f"shrink{i}_slot{e}_{rows}rows")

            def expand_phase(
                c, i=i, e=e, row0=row0, rows=rows, gather=gather, n=n, off=off, b=(b_l, b_perm)
            ):
                p = _expand_template(rows, rank, n, dtype, gather, c)
                p = rebase(p, "a", s_l, offsets=(row0, 0), rename=f"s{i}")
                if gather:
                    p = rebase(p, "idx", rows_l, offsets=(row0, 0), rename="rows")
                p = rebase(p, "b", b[0], lead=(e, 0), perm=b[1], rename=f"b{i}")
                y_at = (0 if gather else starts[e], off)
                p = rebase(p, "out", y_l, offsets=y_at, rename="y")
                return _named(p, f"expand{i}_slot{e}_{rows}rows")

            shrinks.append(shrink_phase)
            expands.append((e, expand_phase))
        off += n
    if not expands:
        raise ProgramError("lora sgmv: no live slot has rows")
    return in_waves(
        f"lora_sgmv_{len(expands)}ph_{k}x{rank}x{'+'.join(map(str, slices))}_{r}of{tokens}rows",
        [shrinks, _slot_major(expands)],
        cfg,
        distinct=("rows",),  # the batch's LoRA tokens in slot order, each once
    )


def _slot_major(expands: list) -> list:
    """The expand phases slot by slot: a slot's slices write disjoint columns,
    two slots' rows are distinct tokens (adjacent runs, or disjoint entries of
    the row table)."""
    return [make for _, make in sorted(expands, key=lambda t: t[0])]


def _b_stack(num: int, n: int, rank: int, dtype: torch.dtype, bt: bool):
    """The layout of one slice's B stack and how its trailing dims map to the
    expand template's b [rank, n]: stored [L, 1, n, r] (perm (1, 0)), or
    transposed, [L, 1, r, n] (as is)."""
    lay = SpyreTensorLayout.default
    if bt:
        return lay((num, 1, rank, n), dtype), None
    return lay((num, 1, n, rank), dtype), (1, 0)


def _splits(rows: int, k: int, n: int, dtype: torch.dtype, cfg: HardwareConfig, split_k: bool):
    pows = [1 << j for j in range(cfg.cores.bit_length()) if 1 << j <= cfg.cores]
    se = stick_elems(dtype)
    return [
        (pm, pn, pk)
        for pm in pows
        for pn in pows
        for pk in (pows if split_k else [1])
        if pm * pn * pk <= cfg.cores and pm <= rows and pn <= -(-n // se) and pk <= k
    ]


@lru_cache(maxsize=512)
def _shrink_template(
    rows: int, k: int, n: int, dtype: torch.dtype, gather: bool, cfg: HardwareConfig
) -> Program:
    """The fastest ``rows x k x n`` matmul, its ``a`` rows gathered through a
    row table when ``gather`` (the search costs the descriptors)."""
    from torch_spyre.kernels.basic import matmul
    from torch_spyre.kernels.search import search

    if not gather:
        return matmul_template(rows, k, n, dtype, cfg)

    def build(sp):
        return _gathered(matmul(rows, n, k, dtype, split=sp, config=cfg), "a")

    return search(_splits(rows, k, n, dtype, cfg, True), build, cfg).result


@lru_cache(maxsize=512)
def _expand_template(
    rows: int, k: int, n: int, dtype: torch.dtype, gather: bool, cfg: HardwareConfig
) -> Program:
    """The fastest ``rows x k x n`` matmul adding into its output in place (K
    not split over cores: each output tile is loaded, added to and stored by
    one core), through a row table when ``gather``."""
    from torch_spyre.kernels.basic import matmul
    from torch_spyre.kernels.search import search

    def build(sp):
        return _accumulated(matmul(rows, n, k, dtype, split=sp, config=cfg), gather)

    return search(_splits(rows, k, n, dtype, cfg, False), build, cfg).result


def _gathered(p: Program, operand: str) -> Program:
    """``p`` reading the rows of ``operand`` (dim ``m``) through the int32 row
    table ``idx`` [rows, 1] (loaded next to the operand's tiles)."""
    steps = []
    for st in p.steps:
        if isinstance(st, Load) and st.operand == operand:
            steps.append(Load("idx_t", "idx", ("m", None), st.loops))
            st = Load(**{**st.__dict__, "rows": "idx_t", "rows_dim": 0})
        steps.append(st)
    return _with_table(p, tuple(steps), ())


def _accumulated(p: Program, gather: bool) -> Program:
    """``p`` adding its result into ``out`` (``out[m] += acc[m]``: load, add,
    store), into the rows named by the row table ``idx`` when ``gather``."""
    steps = []
    dtype = next(b.dtype for b in p.buffers if b.name == "b_t")
    table = {"rows": "idx_t", "rows_dim": 0} if gather else {}
    for st in p.steps:
        if isinstance(st, Store) and st.operand == "out":
            if gather:
                steps.append(Load("idx_t", "idx", ("m", None), st.loops))
            steps += [
                Load("old_t", "out", st.index, st.loops, **table),  # type: ignore[arg-type]
                Vector("add", st.buffer, (st.buffer, "old_t"), (), st.loops),
            ]
            st = Store(**{**st.__dict__, **table})
        steps.append(st)
    old = (Buffer("old_t", ("m", "n"), dtype),)
    if not gather:
        return Program(
            p.name, p.dims, p.operands, (*p.buffers, *old), tuple(steps), p.loop_order,
            dict(p.meta),
        )  # fmt: skip
    return _with_table(p, tuple(steps), old)


def _with_table(p: Program, steps: tuple, buffers: tuple) -> Program:
    """``p`` with ``steps``, the row-table operand ``idx`` and its LX buffer."""
    m = next(d for d in p.dims if d.name == "m")
    return Program(
        p.name,
        p.dims,
        (*p.operands, Operand("idx", SpyreTensorLayout.default((m.size, 1), I32), "input")),
        (*p.buffers, Buffer("idx_t", ("m",), I32), *buffers),
        steps,
        p.loop_order,
        dict(p.meta),
    )


def _named(p: Program, name: str) -> Program:
    return Program(name, p.dims, p.operands, p.buffers, p.steps, p.loop_order, dict(p.meta))
