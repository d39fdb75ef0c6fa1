"""Core counts a planner tries for a dimension of whole sticks, and the
row-block plans (core splits and tiles) of the programs that keep a block of
activation rows in LX while weights stream past it (``kernels.swiglu``,
``kernels.projections``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Program
from torch_spyre.layout import ceil_div


def stick_splits(sticks: int, limit: int) -> list[int]:
    """Core counts to try for a dim of ``sticks`` whole sticks on at most
    ``limit`` cores: the powers of two, and the divisors of ``sticks`` (9
    sticks over 8 cores leave three idle with 2 sticks each; over 9 or 3 every
    core streams an equal share, which is what a decode projection of K or
    N = 576 needs to reach the memory roof).  Used by the matmul planner
    (``kernels.plan``) and the SwiGLU MLP's (``kernels.swiglu``)."""
    pows = {1 << i for i in range(limit.bit_length()) if 1 << i <= min(sticks, limit)}
    return sorted(pows | {d for d in range(3, min(sticks, limit) + 1) if sticks % d == 0})


Split = tuple[int, int, int, int]
Tiles = tuple[int, int, int, int]


def row_block_plans(
    b: int,
    m: int,
    k: int,
    n: int,
    cores: int,
    se: int,
    *,
    batched: bool,
    k_split: bool,
    n_unit: int | None = None,
    n_tiles: tuple[int, ...] = (32, 64, 128),
    k_tiles: tuple[int, ...] = (512, 1024),
) -> Iterator[tuple[Split, list[Tiles]]]:
    """(split, tiles) candidates of a row-block program: cores over (batch,
    rows, columns, k) (k only when ``k_split``), splits that leave half the
    card idle dropped while there is work to split, and splits whose
    whole-stick chunks come out the same planned once; per split the tiles
    (batch, rows, columns, k) clamped to the core's extents.  ``se``: the
    dtype's stick elements; ``n_unit``: the columns' unit of a split (default
    ``se``: whole sticks; 1 for columns counted in heads); ``n_tiles``: the
    column tiles to try; ``k_tiles``: the k tiles besides the core's whole k."""
    pows = [1 << i for i in range(cores.bit_length()) if 1 << i <= cores]
    nu = se if n_unit is None else n_unit
    n_sticks, k_sticks = ceil_div(n, nu), ceil_div(k, se)
    k_splits = stick_splits(k_sticks, cores) if k_split else [1]
    splits = [
        (pb, pm, pn, pk)
        for pb, pm, pn, pk in itertools.product(
            pows if batched else [1], pows, stick_splits(n_sticks, cores), k_splits
        )
        if pb * pm * pn * pk <= cores and pb <= b and pm <= m and pn <= n_sticks and pk <= k_sticks
    ]
    # (small odd shapes, e.g. 3 rows of 4 sticks, have no split using half the card)
    busy = [
        s
        for s in splits
        if not (
            math.prod(s) < cores // 2
            and (s[0] < b or s[1] < m or s[2] < n_sticks or s[3] < k_sticks)
        )
    ]
    planned: set[tuple[int, ...]] = set()
    for pb, pm, pn, pk in busy or splits:
        em = ceil_div(m, pm)
        en = ceil_div(n_sticks, pn) * nu if pn > 1 else n
        ek = ceil_div(k_sticks, pk) * se if pk > 1 else k
        eb = ceil_div(b, pb)
        if (eb, em, en, ek) in planned:
            continue
        planned.add((eb, em, en, ek))
        # row tiles: the core's rows, halves, quarters, and the small tiles a
        # long prompt needs (8192 rows: the activation and fp32 accumulator
        # of 128 rows over a whole k already fill the LX)
        tms = sorted({em, ceil_div(em, 2), ceil_div(em, 4), *(t for t in (32, 64, 128) if t < em)})
        tbs = sorted({1, eb}) if batched else [1]
        tiles = sorted(
            {
                (tb, tm, min(tn, en), min(tk, ek))
                for tb, tm, tn, tk in itertools.product(tbs, tms, n_tiles, (*k_tiles, ek))
            }
        )
        yield (pb, pm, pn, pk), tiles


def row_block_extents(
    m: int,
    n: int,
    k: int,
    pm: int,
    pn: int,
    pk: int,
    se: int,
    tiles: tuple[int, int, int] | None,
    n_unit: int | None = None,
) -> tuple[int, int, int, int, int, tuple[int, int, int]]:
    """(pn, pk, en, ek, em, (tm, tn, tk)) of a row-block split: columns and k
    over cores in whole sticks (the core counts a chunk size leaves; columns
    in units of ``n_unit`` when given), a core's extents, and the tiles
    (default: the core's rows, 64 columns, 512 of k)."""
    nu = se if n_unit is None else n_unit
    en = ceil_div(ceil_div(n, nu), pn) * nu if pn > 1 else n
    pn = ceil_div(n, en)
    ek = ceil_div(ceil_div(k, se), pk) * se if pk > 1 else k
    pk = ceil_div(k, ek)
    em = ceil_div(m, pm)
    return pn, pk, en, ek, em, tiles if tiles is not None else (em, min(en, 64), min(ek, 512))


def double_if_it_fits(program: Callable[[bool], Program], cfg: HardwareConfig) -> Program:
    """``program(True)`` (its accumulators double buffered: the same tiles,
    a block's stores overlapped with the next block instead of serial, never
    slower) where the LX holds it, else ``program(False)``."""
    double = program(True)
    return double if sum(double.lx_usage(cfg).values()) <= cfg.lx_bytes else program(False)
