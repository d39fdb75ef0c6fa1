"""Builders of common kernel programs, for eager ops and hand-written tests.

Each returns a validated-shape ``Program`` whose operand names are given in
its docstring; pass device tensors under those names to ``card.run``.  Tiles
default to the largest that fit the LX budget of the config.
"""

from __future__ import annotations

import itertools
import math

import torch

from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems
from torch_spyre.sim.config import HardwareConfig

# flash attention lives in sim/flash.py; re-exported where the builders always were
from torch_spyre.sim.flash import best_flash_attention, flash_attention  # noqa: F401
from torch_spyre.sim.program import (
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    tiles = fit_tiles(per_core, nbuf * 2 * _itemsize(dtype), cfg.lx_bytes // 2, stick_elems(dtype))
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
    em: int, en: int, ek: int, dtype: torch.dtype, double_buffer: bool, config: HardwareConfig
) -> tuple[int, int, int]:
    """The largest output block (tm, tn) with a k tile of 128, that fits the LX."""
    se = stick_elems(dtype)
    it = _itemsize(dtype)
    copies = 2 if double_buffer else 1
    tk = min(ek, 2 * se)

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
    row = ceil_div(n, se) * se * _itemsize(dtype)
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
        tile = max(se, min(n, cfg.lx_bytes // 4 // (3 * _itemsize(dtype)) // se * se))
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
    from torch_spyre.sim.timing import estimate

    cfg = config or HardwareConfig()
    se = stick_elems(dtype)
    pows = [1 << i for i in range(cfg.cores.bit_length()) if 1 << i <= cfg.cores]
    best: tuple[float, Program] | None = None
    for pm in pows:
        for pn in pows:
            for pk in pows:
                if pm * pn * pk > cfg.cores or pm > m or pn > ceil_div(n, se) or pk > k:
                    continue
                p = matmul(m, n, k, dtype, split=(pm, pn, pk), config=cfg, name=name)
                try:
                    p.validate(cfg)
                except ProgramError:
                    continue
                t = estimate(p, cfg).time_s
                if best is None or t < best[0]:
                    best = (t, p)
    if best is None:
        raise ProgramError(f"no matmul split of {m}x{n}x{k} fits the card")
    return best[1]


# ------------------------------------------------------ fused SwiGLU MLP
def swiglu_mlp(
    b: int,
    m: int,
    k: int,
    n: int,
    e: int | None,
    dtype: torch.dtype = torch.float16,
    *,
    split: tuple[int, int, int] | None = None,
    tiles: tuple[int, int, int] | None = None,
    double_buffer: bool = True,
    batched: bool = True,
    residual: float | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
    tb: int = 1,
    merged: bool = False,
) -> Program:
    """``out = (silu(x @ wg^T) * (x @ wu^T)) @ wd^T`` in one program.

    Two matmuls share the activation tile (loaded once per core, whole k):
    per column block of ``tn`` hidden units the gate and up weight tiles
    stream through the LX (k tiles of ``tk``) into two fp32 accumulators;
    ``silu(g) * u`` runs on the vector units in LX, and the down projection
    consumes that hidden tile at once (``out += h @ wd[:, block]^T``,
    accumulated over the blocks), so the hidden activation never reaches
    device memory.  Weight tiles shared by the cores splitting rows are read
    once per group and multicast over the ring; with the hidden dim split over
    cores the partial outputs are combined by a ring all-reduce.  ``e=None``:
    no down projection (the output is the hidden activation).

    ``k`` over cores (``split``'s 4th entry, ``E == K`` only): each core holds
    a band of k sticks of the activation, gate and up weights (``wg``/``wu``
    are ``[N, K]`` with K the stick dim, so a hidden-dim slice of them spans
    the whole tensor in device memory while a k band is contiguous: this is
    what keeps a core inside its 256 MiB span when the weights are larger);
    the gate and up partial sums of each hidden block are combined by a ring
    all-reduce before ``silu(g) * u``, and the down projection then writes
    the same k band of the output columns (``wd``'s hidden slice of that band),
    so the activation and the output accumulator in LX shrink by the split too.

    Operands (nn.Linear weights): ``x`` [b, m, k] (``batched=False``:
    [m, k]), ``wg``, ``wu`` [n, k], ``wd`` [e, n], ``out`` [b, m, e or n].
    ``split``: cores over (b, m, n) or (b, m, n, k); ``tiles``: (tm, tn, tk);
    ``tb``: batch elements per tile (a decode step's ``[B, 1, K]`` is B rows of
    one token: with ``tb`` > 1 every weight tile serves ``tb * tm`` rows instead
    of being streamed again for each batch element).

    ``merged``: the gate and up weights are the two row halves of one
    ``[2n, k]`` operand ``wgu`` (vLLM's merged ``gate_up_proj``), read in place
    through row offsets.

    ``residual=s`` (with a down projection): ``out = res + s * mlp`` — the
    residual add of a decoder layer as the epilogue of the down projection
    (operand ``res``, shaped like ``out``, loaded per row block next to the
    output accumulator; one rounding on the store).
    """
    cfg = config or HardwareConfig()
    pb, pm, pn, pk = (*split, 1)[:4] if split is not None else (1, min(m, cfg.cores), 1, 1)
    se = stick_elems(dtype)
    en = ceil_div(ceil_div(n, se), pn) * se if pn > 1 else n
    pn = ceil_div(n, en)
    ek = ceil_div(ceil_div(k, se), pk) * se if pk > 1 else k
    pk = ceil_div(k, ek)
    em = ceil_div(m, pm)
    tm, tn, tk = tiles if tiles is not None else (em, min(en, 64), min(ek, 512))
    acc = torch.float32 if dtype.is_floating_point else torch.int32
    down = e is not None
    if pk > 1 and e != k:
        # the k band of the output exists only when the output columns are k
        raise ProgramError("swiglu_mlp: a k split needs the down projection with E == K")
    dims = [
        Dim("b", b, pb, tb),
        Dim("m", m, pm, tm),
        Dim("n", n, pn, tn, chunk=en if pn > 1 else None),
        Dim("k", k, pk, tk, chunk=ek if pk > 1 else None),
    ]
    if down and e != k:
        dims.append(Dim("e", e, 1))
    l2, l3, l4 = ("b", "m"), ("b", "m", "n"), ("b", "m", "n", "k")
    xi = ("b", "m", "k") if batched else ("m", "k")
    xb = ("b", "m", "k")
    hi = ("b", "m", "n")
    db = double_buffer
    w_mc = pb * pm > 1
    # merged: the up rows start n rows into the one gate/up operand
    wg_op, wu_op = ("wgu", "wgu") if merged else ("wg", "wu")
    wg_at, wu_at = ((0, 0), (n, 0)) if merged else ((), ())
    steps: list = [
        Load("xt", "x", xi if batched else ("m", "k"), l2, multicast=pn > 1),
        Load("wgt", wg_op, ("n", "k"), l4, multicast=w_mc, offsets=wg_at),
        Load("wut", wu_op, ("n", "k"), l4, multicast=w_mc, offsets=wu_at),
        Matmul("g", "xt", "wgt", l4),
        Matmul("u", "xt", "wut", l4),
        # k over cores: each holds a partial sum of the hidden block
        *(
            [RingAllReduce("g", "k", "sum", l3), RingAllReduce("u", "k", "sum", l3)]
            if pk > 1
            else []
        ),
        Vector("silu", "g", ("g",), (), l3),
        Vector("mul", "h", ("g", "u"), (), l3),
    ]
    x_dims = xb if batched else ("m", "k")
    buffers = [
        # one activation block per core is loaded once: no second copy
        Buffer("xt", x_dims, dtype, db and (tm < em or tb < ceil_div(b, pb))),
        Buffer("wgt", ("n", "k"), dtype, db),
        Buffer("wut", ("n", "k"), dtype, db),
        Buffer("g", hi if batched else ("m", "n"), acc),
        Buffer("u", hi if batched else ("m", "n"), acc),
        Buffer("h", hi if batched else ("m", "n"), dtype, db and not down),
    ]
    rows = ("b", "m") if batched else ("m",)
    if down and e == k:
        # the output columns walk the k loop again (E == K in a transformer
        # MLP): a second k loop in the same hidden block streams wd in
        # [tk, tn] tiles into the resident output accumulator y[rows, E]
        steps += [
            Load("wdt", "wd", ("k", "n"), l4, multicast=w_mc),
            Matmul("y", "h", "wdt", l4),
        ]
        buffers += [Buffer("wdt", ("k", "n"), dtype, db), Buffer("y", (*rows, "k"), acc)]
        if pn > 1:
            steps.append(RingAllReduce("y", "n", "sum", l2))
        steps.append(Store("out", "y", (*rows, "k"), l2))
    elif down:
        steps += [
            Load("wdt", "wd", ("e", "n"), l3, multicast=w_mc),
            Matmul("y", "h", "wdt", l3),
        ]
        buffers += [Buffer("wdt", ("e", "n"), dtype, db), Buffer("y", (*rows, "e"), acc)]
        if pn > 1:
            steps.append(RingAllReduce("y", "n", "sum", l2))
        steps.append(Store("out", "y", (*rows, "e"), l2))
    else:
        steps.append(Store("out", "h", (*rows, "n"), l3))
    if residual is not None:
        if not down:
            raise ProgramError("swiglu_mlp: a residual needs the down projection")
        ecol = "k" if e == k else "e"
        # E == K: the activation tile is dead once the hidden blocks are
        # done, and the residual tile has its dims: load it into that LX
        rt = "xt" if ecol == "k" and batched else "rt"
        store = steps.pop()
        steps += [
            # the cores splitting the hidden dim all add the same rows: read
            # once per group and shared over the ring, like the activation
            Load(rt, "res", (*rows, ecol), l2, multicast=pn > 1),
            Vector("mul_scalar", "y", ("y",), (float(residual),), l2),
            Vector("add", "y", ("y", rt), (), l2),
            store,
        ]
        if rt == "rt":
            buffers.append(Buffer("rt", (*rows, ecol), dtype))
    xs = (b, m, k) if batched else (m, k)
    outs = (b, m, e if down else n) if batched else (m, e if down else n)
    if not batched and b != 1:
        raise ProgramError("swiglu_mlp: an unbatched x needs b == 1")
    operands = [
        Operand("x", SpyreTensorLayout.default(xs, dtype), "input"),
        *(
            [Operand("wgu", SpyreTensorLayout.default((2 * n, k), dtype), "input")]
            if merged
            else [
                Operand("wg", SpyreTensorLayout.default((n, k), dtype), "input"),
                Operand("wu", SpyreTensorLayout.default((n, k), dtype), "input"),
            ]
        ),
    ]
    if down:
        operands.append(Operand("wd", SpyreTensorLayout.default((e, n), dtype), "input"))
    if residual is not None:
        operands.append(Operand("res", SpyreTensorLayout.default(outs, dtype), "input"))
    operands.append(Operand("out", SpyreTensorLayout.default(outs, dtype), "output"))
    if not batched:
        # an unbatched program has no b dim in its buffers: drop it
        dims = [d for d in dims if d.name != "b"]
        loops = tuple(x for x in l4 if x != "b")
        steps = [
            type(s)(**{**s.__dict__, "loops": tuple(x for x in s.loops if x != "b")}) for s in steps
        ]
        order = loops
    else:
        order = l4
    return Program(
        name=name
        or f"swiglu_mlp_{b * m}x{k}x{n}"
        + (f"x{e}" if down else "")
        + ("_res" if residual is not None else ""),
        dims=tuple(dims),
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=order,
    )


def stick_splits(sticks: int, limit: int) -> list[int]:
    """Core counts to try for a dim of ``sticks`` whole sticks on at most
    ``limit`` cores: the powers of two, and the divisors of ``sticks`` (9
    sticks over 8 cores leave three idle with 2 sticks each; over 9 or 3 every
    core streams an equal share, which is what a decode projection of K or
    N = 576 needs to reach the memory roof)."""
    pows = {1 << i for i in range(limit.bit_length()) if 1 << i <= min(sticks, limit)}
    return sorted(pows | {d for d in range(3, min(sticks, limit) + 1) if sticks % d == 0})


def best_swiglu_mlp(
    b: int,
    m: int,
    k: int,
    n: int,
    e: int | None,
    dtype: torch.dtype = torch.float16,
    *,
    batched: bool = True,
    residual: float | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
    merged: bool = False,
) -> Program:
    """The fused SwiGLU MLP program the timing model finds fastest: core
    splits over (b, rows, hidden, k) and tiles (batch, rows, hidden block, k)
    that fit the LX and a core's address span.

    k over cores is what plans weights whose hidden slices span more than a
    core's 256 MiB (Llama-3.1-70B: 8192 x 28672, 14336 per card at TP 2);
    a batch tile of the whole per-core batch lets a decode step's weight
    tiles serve all its requests at once."""
    from torch_spyre.sim.timing import estimate

    cfg = config or HardwareConfig()
    se = stick_elems(dtype)
    pows = [1 << i for i in range(cfg.cores.bit_length()) if 1 << i <= cfg.cores]
    best: tuple[float, Program] | None = None
    n_sticks, k_sticks = ceil_div(n, se), ceil_div(k, se)
    npows = stick_splits(n_sticks, cfg.cores)
    # a k split needs the output columns to be k
    kpows = stick_splits(k_sticks, cfg.cores) if e == k else [1]
    splits = [
        (pb, pm, pn, pk)
        for pb, pm, pn, pk in itertools.product(pows if batched else [1], pows, npows, kpows)
        if pb * pm * pn * pk <= cfg.cores
        and pb <= b
        and pm <= m
        and pn <= n_sticks
        and pk <= k_sticks
    ]
    busy = [
        s
        for s in splits
        # not one that leaves half the card idle although there is work to split
        if not (
            math.prod(s) < cfg.cores // 2
            and (s[0] < b or s[1] < m or s[2] < n_sticks or s[3] < k_sticks)
        )
    ]
    # (small odd shapes, e.g. 3 rows of 4 sticks, have no split using half the card)
    planned: set[tuple[int, ...]] = set()
    for pb, pm, pn, pk in busy or splits:
        em = ceil_div(m, pm)
        en = ceil_div(n_sticks, pn) * se if pn > 1 else n
        ek = ceil_div(k_sticks, pk) * se if pk > 1 else k
        eb = ceil_div(b, pb)
        # splits whose whole-stick chunks come out the same are one plan
        if (eb, em, en, ek) in planned:
            continue
        planned.add((eb, em, en, ek))
        tms = sorted({em, ceil_div(em, 2), ceil_div(em, 4)})
        tbs = sorted({1, eb}) if batched else [1]
        # tiles clamped to the core's extents, each distinct one planned once
        tiles = sorted(
            {
                (tb, tm, min(tn, en), min(tk, ek))
                for tb, tm, tn, tk in itertools.product(tbs, tms, (32, 64, 128), (512, 1024, ek))
            }
        )
        for tb, tm, tn, tk in tiles:
            p = swiglu_mlp(
                b, m, k, n, e, dtype, split=(pb, pm, pn, pk), tiles=(tm, tn, tk),
                batched=batched, residual=residual, config=cfg, name=name, tb=tb,
                merged=merged,
            )  # fmt: skip
            try:
                p.validate(cfg)
            except ProgramError:
                continue
            t = estimate(p, cfg).time_s
            if best is None or t < best[0] - 1e-12:
                best = (t, p)
    if best is None:
        raise ProgramError(f"fused SwiGLU MLP {b * m}x{k}x{n}: no plan fits the card")
    return best[1]
