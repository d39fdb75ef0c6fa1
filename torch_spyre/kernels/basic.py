"""Builders of common kernel programs, for eager ops and hand-written tests.

Each returns a validated-shape ``Program`` whose operand names are given in
its docstring; pass device tensors under those names to ``card.run``.  Tiles
default to the largest that fit the LX budget of the config.
"""

from __future__ import annotations

import math

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

# flash attention lives in kernels/flash.py, the SwiGLU MLP in kernels/swiglu.py;
# re-exported where the builders always were
from torch_spyre.kernels.flash import best_flash_attention, flash_attention  # noqa: F401
from torch_spyre.kernels.search import persisted
from torch_spyre.kernels.swiglu import best_swiglu_mlp, swiglu_mlp  # noqa: F401
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


def _cores(config: HardwareConfig | None, cores: int | None, size: int) -> int:
    n = cores if cores is not None else (config or HardwareConfig()).cores
    return max(1, min(n, size))


def fit_tiles(sizes: list[int], bytes_per_elem: float, budget: int, stick: int) -> list[int]:
    """Tiles (inner dim first to fill) so that a tile of all buffers fits ``budget``."""
    tiles = [1] * len(sizes)
    elems = max(1, int(budget / bytes_per_elem))
    inner = sizes[-1]
    if ceil_div(inner, stick) * stick <= elems:
        tiles[-1] = inner
    else:
        tiles[-1] = max(stick, elems // stick * stick)
    acc = ceil_div(tiles[-1], stick) * stick
    for i in range(len(sizes) - 2, -1, -1):
        tiles[i] = max(1, min(sizes[i], elems // acc))
        acc *= tiles[i]
    return tiles


def elementwise(
    op: str,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
    num_inputs: int = 2,
    scalars: tuple[float, ...] = (),
    cores: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
    input_shapes: list[tuple[int, ...]] | None = None,
    input_dtypes: list[torch.dtype] | None = None,
) -> Program:
    """``out = op(in0[, in1], *scalars)``; operands ``in0``, ``in1``..., ``out``.

    ``out`` has ``shape`` and ``dtype``; inputs default to the same, or take
    ``input_shapes`` that broadcast to ``shape`` (torch rules, e.g. a bias
    ``(n,)`` against ``(m, n)``) and ``input_dtypes``.  All operands use the
    default layout.  The host dim behind the outermost device dim is split
    over the cores (contiguous slices; whole sticks when it is the stick dim);
    each core walks tiles sized so the double-buffered buffers fill half the
    LX (the rest is headroom for a fused producer).
    """
    cfg = config or HardwareConfig()
    shape = tuple(int(s) for s in shape) or (1,)
    names = [f"d{i}" for i in range(len(shape))]
    lay = SpyreTensorLayout.default(shape, dtype)
    split, ncores, chunk = _elementwise_split(lay, cores if cores is not None else cfg.cores)
    per_core = list(shape)
    per_core[split] = chunk
    nbuf = num_inputs + 1
    tiles = fit_tiles(per_core, nbuf * 2 * dtype.itemsize, cfg.lx_bytes // 2, stick_elems(dtype))
    dims = tuple(
        Dim(n, s, cores=ncores if i == split else 1, tile=t, chunk=chunk if i == split else None)
        for i, (n, s, t) in enumerate(zip(names, shape, tiles))
    )
    ins = [f"in{i}" for i in range(num_inputs)]
    shapes = [tuple(x) for x in input_shapes] if input_shapes else [shape] * num_inputs
    dtypes = list(input_dtypes) if input_dtypes else [dtype] * num_inputs
    if len(shapes) != num_inputs or len(dtypes) != num_inputs:
        raise ProgramError(f"elementwise {op!r}: give one shape and dtype per input")
    loops = tuple(names)
    idx = tuple(names)
    steps: list = []
    operands, buffers = [], []
    for x, xs, xd in zip(ins, shapes, dtypes):
        xidx = broadcast_index(xs, shape, names, op)
        steps.append(Load(f"{x}_t", x, xidx, loops))
        operands.append(Operand(x, SpyreTensorLayout.default(xs, xd), "input"))
        buffers.append(Buffer(f"{x}_t", tuple(d for d in xidx if d), xd, True))
    steps.append(Vector(op, "out_t", tuple(f"{x}_t" for x in ins), tuple(scalars), loops))
    steps.append(Store("out", "out_t", idx, loops))
    return Program(
        name=name or f"{op}_{'x'.join(map(str, shape))}",
        dims=dims,
        operands=tuple(operands) + (Operand("out", lay, "output"),),
        buffers=tuple(buffers) + (Buffer("out_t", idx, dtype, True),),
        steps=tuple(steps),
        loop_order=loops,
    )


def broadcast_index(
    xs: tuple[int, ...], shape: tuple[int, ...], names: list[str], op: str
) -> tuple[str | None, ...]:
    """Iteration dim of each host dim of an input broadcast (right-aligned) to ``shape``."""
    off = len(shape) - len(xs)
    if off < 0:
        raise ProgramError(
            f"elementwise {op!r}: input shape {list(xs)} has more dims than {list(shape)}"
        )
    index: list[str | None] = []
    for j, s in enumerate(xs):
        if s == shape[off + j]:
            index.append(names[off + j])
        elif s == 1:
            index.append(None)
        else:
            raise ProgramError(
                f"elementwise {op!r}: input shape {list(xs)} does not broadcast to {list(shape)}"
            )
    return tuple(index)


def _elementwise_split(lay: SpyreTensorLayout, cores: int) -> tuple[int, int, int]:
    """(host dim to split, cores, elements per core).

    Prefer the host dim of the outermost device dim: each core's slice is
    then one contiguous range of device memory (fewest DMA descriptors, the
    smallest address span).  Split the stick dim in whole sticks only, so no
    two cores write one stick.  Fall back to the dim with the most pieces.
    """
    se = lay.stick_elems
    n = len(lay.host_size)

    def pieces(k: int) -> int:
        return ceil_div(lay.host_size[k], se) if k == lay.stick_dim else lay.host_size[k]

    first = lay.dim_map[0] if lay.dim_map[0] >= 0 else 0
    k = first if pieces(first) >= cores else max(range(n), key=lambda i: (pieces(i), i == first))
    per = ceil_div(pieces(k), max(1, min(cores, pieces(k))))
    chunk = per * se if k == lay.stick_dim else per
    chunk = min(chunk, lay.host_size[k])
    return k, ceil_div(lay.host_size[k], chunk), chunk


def matmul(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float16,
    split: tuple[int, int, int] | None = None,
    tiles: tuple[int, int, int] | None = None,
    double_buffer: bool = True,
    multicast: bool = True,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out[m,n] = a[m,k] @ b[k,n]`` on the PE arrays; operands ``a``, ``b``, ``out``.

    ``multicast``: an ``a`` tile shared by the cores splitting N (and a
    ``b`` tile by those splitting M) is read from device memory once per
    group and shared over the ring.

    ``split`` = cores over (M, N, K); with K split, each core's fp32 partial
    sums are combined by a ring all-reduce before the store.  ``tiles`` =
    (tm, tn, tk) per core; loops run m, n (output blocks) then k (streamed).
    """
    cfg = config or HardwareConfig()
    if split is None:
        split = default_matmul_split(m, n, k, cfg)
    pm, pn, pk = split
    se = stick_elems(dtype)
    # N is the stick dim of ``out``: give each core whole sticks of it
    en = ceil_div(ceil_div(n, se), pn) * se if pn > 1 else n
    pn = ceil_div(n, en)
    em, ek = ceil_div(m, pm), ceil_div(k, pk)
    if tiles is None:
        tiles = default_matmul_tiles(em, en, ek, dtype, double_buffer, cfg)
    tm, tn, tk = tiles
    dims = (
        Dim("m", m, pm, tm),
        Dim("n", n, pn, tn, chunk=en if pn > 1 else None),
        Dim("k", k, pk, tk),
    )
    acc = torch.float32 if dtype.is_floating_point else torch.int32
    loops = ("m", "n", "k")
    steps: list = [
        Load("a_t", "a", ("m", "k"), loops, multicast=multicast and pn > 1),
        Load("b_t", "b", ("k", "n"), loops, multicast=multicast and pm > 1),
        Matmul("acc", "a_t", "b_t", loops),
    ]
    if pk > 1:
        steps.append(RingAllReduce("acc", "k", "sum", loops[:2]))
    steps.append(Store("out", "acc", ("m", "n"), loops[:2]))
    return Program(
        name=name or f"mm_{m}x{n}x{k}" + ("" if multicast or pm * pn == 1 else "_nomc"),
        dims=dims,
        operands=(
            Operand("a", SpyreTensorLayout.default((m, k), dtype), "input"),
            Operand("b", SpyreTensorLayout.default((k, n), dtype), "input"),
            Operand("out", SpyreTensorLayout.default((m, n), dtype), "output"),
        ),
        buffers=(
            Buffer("a_t", ("m", "k"), dtype, double_buffer),
            Buffer("b_t", ("k", "n"), dtype, double_buffer),
            Buffer("acc", ("m", "n"), acc, double_buffer),
        ),
        steps=tuple(steps),
        loop_order=loops,
    )


def default_matmul_split(m: int, n: int, k: int, config: HardwareConfig) -> tuple[int, int, int]:
    """Spread the output over the cores, most cores on the larger output dim."""
    cores = config.cores
    best = (1, 1, 1)
    best_cost = math.inf
    for pm in range(1, cores + 1):
        if cores % pm:
            continue
        pn = cores // pm
        if pm > m or pn > ceil_div(n, 64):
            continue
        # per-core traffic of a streamed-K block: (m/pm + n/pn) * k
        cost = (ceil_div(m, pm) + ceil_div(n, pn)) * k
        if cost < best_cost:
            best, best_cost = (pm, pn, 1), cost
    if best == (1, 1, 1) and cores > 1 and m * n < cores:
        best = (1, 1, min(cores, k))
    return best


def default_matmul_tiles(
    em: int,
    en: int,
    ek: int,
    dtype: torch.dtype,
    double_buffer: bool,
    config: HardwareConfig,
    whole_k: bool = False,
) -> tuple[int, int, int]:
    """The largest output block (tm, tn) with a k tile of 128, that fits the LX.

    ``whole_k``: the k tile is the core's whole k, so a row tile of the
    activation is loaded once and stays in the LX while every column tile of
    the weight streams past it (activation-stationary; rows grown first)."""
    se = stick_elems(dtype)
    it = dtype.itemsize
    copies = 2 if double_buffer else 1
    tk = ek if whole_k else min(ek, 2 * se)

    def lx(tm: int, tn: int) -> int:
        pad = lambda x: ceil_div(x, se) * se  # noqa: E731
        return copies * (tm * pad(tk) * it + tk * pad(tn) * it + tm * pad(tn) * 4)

    tm, tn = min(em, 8), min(en, se)
    while True:
        grown = False
        for cand in ((min(em, tm * 2), tn), (tm, min(en, tn * 2))):
            if cand != (tm, tn) and lx(*cand) <= config.lx_bytes:
                tm, tn = cand
                grown = True
                break
        if not grown:
            return tm, tn, tk


def softmax(
    m: int,
    n: int,
    dtype: torch.dtype = torch.float16,
    cores: int | None = None,
    spill: bool = False,
    rows_per_tile: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """Row softmax of ``x[m,n]`` into ``out``; rows split over cores.

    Steps per row tile: max, exp(x - max), sum, reciprocal, scale, as the
    vector unit does them (the division becomes one reciprocal per row and a
    multiply).  ``spill=True`` models an LX-unaware schedule: exp(x - max) is
    written to device memory (operand ``tmp``) and read back before the sum.
    """
    cfg = config or HardwareConfig()
    ncores = _cores(cfg, cores, m)
    em = ceil_div(m, ncores)
    se = stick_elems(dtype)
    row = ceil_div(n, se) * se * dtype.itemsize
    if rows_per_tile is None:
        # x, y double buffered, e single: 5 row copies per tile in half the LX
        # at least 8 tiles per core, so pipeline fill and drain cost <= 1/8
        rows_per_tile = max(1, min(ceil_div(em, 8), cfg.lx_bytes // 2 // (5 * row)))
    dims = (Dim("m", m, ncores, rows_per_tile), Dim("n", n))
    L = ("m",)
    lay = SpyreTensorLayout.default((m, n), dtype)
    steps: list = [
        Load("x_t", "x", ("m", "n"), L),
        Reduce("max", "mx", "x_t", "n", L),
        Vector("sub", "e", ("x_t", "mx"), (), L),
        Vector("exp", "e", ("e",), (), L),
    ]
    operands = [Operand("x", lay, "input")]
    if spill:
        operands.append(Operand("tmp", lay, "inout"))
        steps += [Store("tmp", "e", ("m", "n"), L), Load("e2", "tmp", ("m", "n"), L)]
    src = "e2" if spill else "e"
    steps += [
        Reduce("sum", "s", src, "n", L),
        Vector("reciprocal", "s", ("s",), (), L),
        Vector("mul", "y_t", (src, "s"), (), L),
        Store("out", "y_t", ("m", "n"), L),
    ]
    operands.append(Operand("out", lay, "output"))
    buffers = [
        Buffer("x_t", ("m", "n"), dtype, True),
        Buffer("mx", ("m",), torch.float32),
        Buffer("e", ("m", "n"), dtype, spill),
        Buffer("s", ("m",), torch.float32),
        Buffer("y_t", ("m", "n"), dtype, True),
    ]
    if spill:
        buffers.append(Buffer("e2", ("m", "n"), dtype, True))
    return Program(
        name=name or f"softmax_{m}x{n}{'_spill' if spill else ''}",
        dims=dims,
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=L,
    )


def rmsnorm(
    m: int,
    n: int,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float16,
    cores: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out = x * rsqrt(mean(x^2, -1) + eps) * w``; operands ``x[m,n]``, ``w[n]``, ``out``.

    The weight is loaded once per core (outside the row loop); the squares
    and the normalised rows are fp32 in LX, rounded once on the store.
    """
    cfg = config or HardwareConfig()
    ncores = _cores(cfg, cores, m)
    em = ceil_div(m, ncores)
    se32 = stick_elems(torch.float32)
    row32 = ceil_div(n, se32) * se32 * 4
    # x, out double buffered (16-bit), sq and y fp32: ~6 fp32 rows per row
    rows = max(1, min(em, (cfg.lx_bytes // 2 - row32) // (6 * row32)))
    L = ("m",)
    steps = (
        Load("w_t", "w", ("n",), ()),
        Load("x_t", "x", ("m", "n"), L),
        Vector("square", "sq", ("x_t",), (), L),
        Reduce("sum", "ss", "sq", "n", L),
        Vector("mul_scalar", "ss", ("ss",), (1.0 / n,), L),
        Vector("add_scalar", "ss", ("ss",), (eps,), L),
        Vector("rsqrt", "ss", ("ss",), (), L),
        Vector("mul", "y", ("x_t", "ss"), (), L),
        Vector("mul", "y", ("y", "w_t"), (), L),
        Store("out", "y", ("m", "n"), L),
    )
    return Program(
        name=name or f"rmsnorm_{m}x{n}",
        dims=(Dim("m", m, ncores, rows), Dim("n", n)),
        operands=(
            Operand("x", SpyreTensorLayout.default((m, n), dtype), "input"),
            Operand("w", SpyreTensorLayout.default((n,), dtype), "input"),
            Operand("out", SpyreTensorLayout.default((m, n), dtype), "output"),
        ),
        buffers=(
            Buffer("w_t", ("n",), torch.float32),
            Buffer("x_t", ("m", "n"), dtype, True),
            Buffer("sq", ("m", "n"), torch.float32),
            Buffer("ss", ("m",), torch.float32),
            Buffer("y", ("m", "n"), torch.float32, True),
        ),
        steps=steps,
        loop_order=L,
    )


def layernorm(
    m: int,
    n: int,
    eps: float = 1e-5,
    dtype: torch.dtype = torch.float16,
    cores: int | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out = (x - mean) * rsqrt(var + eps) * w + b``; operands ``x``, ``w``, ``b``, ``out``."""
    cfg = config or HardwareConfig()
    ncores = _cores(cfg, cores, m)
    em = ceil_div(m, ncores)
    se32 = stick_elems(torch.float32)
    row32 = ceil_div(n, se32) * se32 * 4
    rows = max(1, min(em, (cfg.lx_bytes // 2 - 2 * row32) // (6 * row32)))
    L = ("m",)
    steps = (
        Load("w_t", "w", ("n",), ()),
        Load("b_t", "b", ("n",), ()),
        Load("x_t", "x", ("m", "n"), L),
        Reduce("sum", "mu", "x_t", "n", L),
        Vector("mul_scalar", "mu", ("mu",), (1.0 / n,), L),
        Vector("sub", "xc", ("x_t", "mu"), (), L),
        Vector("square", "y", ("xc",), (), L),
        Reduce("sum", "var", "y", "n", L),
        Vector("mul_scalar", "var", ("var",), (1.0 / n,), L),
        Vector("add_scalar", "var", ("var",), (eps,), L),
        Vector("rsqrt", "var", ("var",), (), L),
        Vector("mul", "y", ("xc", "var"), (), L),
        Vector("mul", "y", ("y", "w_t"), (), L),
        Vector("add", "y", ("y", "b_t"), (), L),
        Store("out", "y", ("m", "n"), L),
    )
    vec = SpyreTensorLayout.default((n,), dtype)
    return Program(
        name=name or f"layernorm_{m}x{n}",
        dims=(Dim("m", m, ncores, rows), Dim("n", n)),
        operands=(
            Operand("x", SpyreTensorLayout.default((m, n), dtype), "input"),
            Operand("w", vec, "input"),
            Operand("b", vec, "input"),
            Operand("out", SpyreTensorLayout.default((m, n), dtype), "output"),
        ),
        buffers=(
            Buffer("w_t", ("n",), torch.float32),
            Buffer("b_t", ("n",), torch.float32),
            Buffer("x_t", ("m", "n"), dtype, True),
            Buffer("mu", ("m",), torch.float32),
            Buffer("xc", ("m", "n"), torch.float32),
            Buffer("var", ("m",), torch.float32),
            Buffer("y", ("m", "n"), torch.float32, True),
        ),
        steps=steps,
        loop_order=L,
    )


def ring_allreduce(
    cores: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    tile: int | None = None,
    op: str = "sum",
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out[n] = op over c of x[c, n]``: core c holds row c; operands ``x``, ``out``.

    Each core loads its row, the ring all-reduce combines the rows (every
    core ends with the result), and core 0 stores it.  ``n`` is walked in
    tiles of ``tile`` elements (default: what fits a quarter of the LX).
    """
    cfg = config or HardwareConfig()
    if cores > cfg.cores:
        raise ProgramError(f"ring all-reduce over {cores} cores, but the card has {cfg.cores}")
    se = stick_elems(dtype)
    if tile is None:
        tile = max(se, min(n, cfg.lx_bytes // 4 // (3 * dtype.itemsize) // se * se))
    L = ("n",)
    return Program(
        name=name or f"allreduce_{op}_{cores}x{n}",
        dims=(Dim("c", cores, cores), Dim("n", n, 1, tile)),
        operands=(
            Operand("x", SpyreTensorLayout.default((cores, n), dtype), "input"),
            Operand("out", SpyreTensorLayout.default((n,), dtype), "output"),
        ),
        buffers=(
            Buffer("x_t", ("c", "n"), dtype, True),
            Buffer("r", ("n",), dtype, True),
        ),
        steps=(
            Load("x_t", "x", ("c", "n"), L),
            Reduce(op, "r", "x_t", "c", L),
            RingAllReduce("r", "c", op, L),
            Store("out", "r", ("n",), L),
        ),
        loop_order=L,
    )


def gemv(
    k: int,
    n: int,
    cores: int | None = None,
    dtype: torch.dtype = torch.float16,
    multicast: bool = True,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out[1,n] = x[1,k] @ w[k,n]``, N split over cores (decode projections)."""
    cfg = config or HardwareConfig()
    ncores = _cores(cfg, cores, n)
    return matmul(
        1,
        n,
        k,
        dtype,
        split=(1, ncores, 1),
        multicast=multicast,
        config=cfg,
        name=name or f"gemv_{k}x{n}",
    )


@persisted("matmul")
def best_matmul(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float16,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """The matmul program the timing model finds fastest on ``config``.

    Searches core splits (M, N, K over power-of-two core counts up to the
    card, fewer cores included: small problems lose more to replicated
    operand traffic than they gain) with the default tiles; a closed-form
    estimate costs about a millisecond, so this suits a kernel cache.
    """
    from torch_spyre.kernels.search import NoPlan, search

    cfg = config or HardwareConfig()
    se = stick_elems(dtype)
    pows = [1 << i for i in range(cfg.cores.bit_length()) if 1 << i <= cfg.cores]
    splits = [
        (pm, pn, pk)
        for pm in pows
        for pn in pows
        for pk in pows
        if not (pm * pn * pk > cfg.cores or pm > m or pn > ceil_div(n, se) or pk > k)
    ]
    try:
        found = search(
            splits, lambda s: matmul(m, n, k, dtype, split=s, config=cfg, name=name), cfg,
            rejected=(ProgramError,),
        )  # fmt: skip
    except NoPlan:
        raise ProgramError(f"no matmul split of {m}x{n}x{k} fits the card") from None
    return found.result
