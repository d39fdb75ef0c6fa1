"""Kernel programs for eager ops whose shapes the sim's stock builders don't cover:
broadcasting elementwise ops with mixed dtypes, and reductions along one dim.
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
    Reduce,
    RingAllReduce,
    Store,
    Vector,
)
from torch_spyre.kernels.basic import broadcast_index, fit_tiles
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


def _split(shape: tuple[int, ...], cores: int, stick: int) -> tuple[int, int, int | None]:
    """(dim, cores, chunk) of the core split that keeps the most cores busy.

    The last dim is the stick dim of the default layout: split over cores it
    goes in whole sticks (two cores never write one stick), so it is used
    only when it feeds more cores than any other dim.
    """
    best = (0, 1, None)
    for i, s in enumerate(shape[:-1]):
        n = min(cores, s)
        if n > best[1]:
            best = (i, n, None)
    last = len(shape) - 1
    sticks = -(-shape[last] // stick)
    n = min(cores, sticks)
    if n > best[1]:
        chunk = -(-sticks // n) * stick
        best = (last, -(-shape[last] // chunk), chunk)
    return best


def _core_dims(
    shape: tuple[int, ...], dtype_bytes: float, cfg: HardwareConfig, names: list[str], stick: int
) -> tuple[Dim, ...]:
    sd, ncores, chunk = _split(shape, cfg.cores, stick)
    per_core = list(shape)
    per_core[sd] = chunk or ceil_div(shape[sd], ncores)
    # double-buffered operand tiles in half the LX
    tiles = fit_tiles(per_core, 2 * dtype_bytes, cfg.lx_bytes // 2, stick)
    return tuple(
        Dim(n, s, cores=ncores if i == sd else 1, tile=t, chunk=chunk if i == sd else None)
        for i, (n, s, t) in enumerate(zip(names, shape, tiles))
    )


def pointwise(
    op: str,
    out_shape: tuple[int, ...],
    out_dtype: torch.dtype,
    inputs: list[tuple[tuple[int, ...], torch.dtype]],
    scalars: tuple[float, ...] = (),
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out = op(in0, in1, ..., *scalars)`` with numpy broadcasting.

    Operands ``in0``.. (shapes right-aligned to ``out_shape``) and ``out``,
    each whole in its default layout (scalars as 1-element vectors).
    """
    cfg = config or HardwareConfig()
    shape = tuple(out_shape) or (1,)
    names = [f"d{i}" for i in range(len(shape))]
    item = out_dtype.itemsize
    in_bytes = sum(dt.itemsize for _, dt in inputs)
    # a split of the stick dim must be whole sticks of every operand
    stick = max(stick_elems(dt) for dt in [out_dtype] + [d for _, d in inputs])
    dims = _core_dims(shape, in_bytes + item, cfg, names, stick)
    loops = tuple(names)
    operands, buffers, steps = [], [], []
    for i, (ishape, idt) in enumerate(inputs):
        ishape = tuple(ishape) or (1,)
        index = broadcast_index(ishape, shape, names, op)
        used = tuple(d for d in index if d is not None)
        operands.append(Operand(f"in{i}", SpyreTensorLayout.default(ishape, idt), "input"))
        buffers.append(Buffer(f"in{i}_t", used, idt, True))
        # a broadcast operand is loaded once per tile of the dims it has
        steps.append(Load(f"in{i}_t", f"in{i}", index, _loop_prefix(loops, used)))
    operands.append(Operand("out", SpyreTensorLayout.default(shape, out_dtype), "output"))
    buffers.append(Buffer("out_t", tuple(names), out_dtype, True))
    steps.append(Vector(op, "out_t", tuple(f"in{i}_t" for i in range(len(inputs))), scalars, loops))
    steps.append(Store("out", "out_t", tuple(names), loops))
    return Program(
        name=name or f"{op}_{'x'.join(map(str, shape))}",
        dims=dims,
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )


def _loop_prefix(loops: tuple[str, ...], used: tuple[str, ...]) -> tuple[str, ...]:
    """The longest prefix of ``loops`` whose innermost dim the buffer has."""
    last = max((loops.index(d) for d in used), default=-1)
    return loops[: last + 1]


def reduction(
    op: str,
    shape: tuple[int, ...],
    dim: int,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
    combinable: bool,
    post_scale: float | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """``out = op over dim of x`` (times ``post_scale``, e.g. 1/n for a mean); operands ``x`` (``shape``) and ``out`` (``shape``
    without ``dim``; a 1-element vector when nothing is left).

    Kept dims are split over the cores; when the reduced dim is all there is
    and ``op`` combines partial results (sum, max, ...), it is split over the
    cores and a ring all-reduce joins the partials.
    """
    cfg = config or HardwareConfig()
    shape = tuple(shape) or (1,)
    dim %= len(shape)
    names = [f"d{i}" for i in range(len(shape))]
    r = names[dim]
    kept = [n for n in names if n != r]
    kept_shape = tuple(s for i, s in enumerate(shape) if i != dim)
    dims, loops, ncores = _rowwise_dims(
        shape, dim, in_dtype, out_dtype, row_copies=3, cfg=cfg, tile_rows=combinable
    )
    acc = torch.float32 if in_dtype.is_floating_point else out_dtype
    out_shape = kept_shape or (1,)
    # steps after the reduction run once its (possibly streamed) row is done
    outer = loops[:-1] if loops and loops[-1] == r else loops
    steps = [Load("x_t", "x", tuple(names), loops), Reduce(op, "r", "x_t", r, loops)]
    if not kept and ncores > 1:
        steps.append(RingAllReduce("r", r, op, outer))
    if post_scale is not None:
        steps.append(Vector("mul_scalar", "r", ("r",), (post_scale,), outer))
    steps.append(Store("out", "r", tuple(kept) or (None,), outer))
    return Program(
        name=name or f"{op}_{'x'.join(map(str, shape))}_dim{dim}",
        dims=tuple(dims),
        operands=(
            Operand("x", SpyreTensorLayout.default(shape, in_dtype), "input"),
            Operand("out", SpyreTensorLayout.default(out_shape, out_dtype), "output"),
        ),
        buffers=(
            Buffer("x_t", tuple(names), in_dtype, True),
            Buffer("r", tuple(kept), acc if op_keeps_acc(op) else out_dtype, False),
        ),
        steps=tuple(steps),
        loop_order=tuple(loops),
    )


def _rowwise_dims(
    shape: tuple[int, ...],
    dim: int,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
    row_copies: int,
    cfg: HardwareConfig,
    tile_rows: bool,
) -> tuple[list[Dim], tuple[str, ...], int]:
    """Dims and loops of a kernel that works on whole rows along ``dim``.

    The kept dims are split over the cores (the last kept one, the output's
    stick dim, in whole sticks) and walked in tiles of rows that fit
    ``row_copies`` fp32 rows in half the LX.  With no kept dim, the row itself
    is split over the cores when ``tile_rows`` (the op combines partial
    results); a row too long for the LX is then also walked in tiles.
    Returns (dims, loops, cores over the reduced dim).
    """
    names = [f"d{i}" for i in range(len(shape))]
    r = names[dim]
    kept_shape = tuple(s for i, s in enumerate(shape) if i != dim)
    se = stick_elems(in_dtype)
    row = ceil_div(shape[dim], se) * se * 4
    budget = cfg.lx_bytes // 2
    if kept_shape:
        kept = [n for n in names if n != r]
        ksd, ncores, chunk = _split(kept_shape, cfg.cores, max(se, stick_elems(out_dtype)))
        sd = names.index(kept[ksd])
        per_core = chunk or ceil_div(shape[sd], ncores)
        rows_budget = budget // (row_copies * row)
        dims = []
        rtile = None
        if rows_budget < 1 and tile_rows:  # a row longer than the LX: stream it
            rtile = max(se, budget // (row_copies * 4) // se * se)
            rows_budget = 1
        for i, (n, s) in enumerate(zip(names, shape)):
            if i == dim:
                dims.append(Dim(n, s, 1, rtile))
            elif i == sd:
                dims.append(Dim(n, s, ncores, max(1, min(per_core, rows_budget)), chunk))
            else:
                dims.append(Dim(n, s, 1, 1 if i < sd else s))
        loops = tuple(n for i, n in enumerate(names) if i != dim and i <= sd)
        if rtile is not None:
            loops += (r,)
        return dims, loops, 1
    ncores = min(cfg.cores, ceil_div(shape[0], se)) if tile_rows else 1
    chunk = ceil_div(ceil_div(shape[0], ncores), se) * se if ncores > 1 else None
    ncores = ceil_div(shape[0], chunk) if chunk else 1
    per_core = chunk or shape[0]
    tile = max(se, min(per_core, budget // (row_copies * 4) // se * se))
    loops = (r,) if tile_rows else ()
    return [Dim(r, shape[0], ncores, tile, chunk)], loops, ncores


def _compiler_plan(prog: Program, cfg: HardwareConfig) -> Program:
    """``prog`` with the compiler's split / tiles / multicast search (its
    steps stay): an eager kernel modelled as the same op compiled alone."""
    from torch_spyre.kernels.plan import replan

    return replan(prog, cfg)


def op_keeps_acc(op: str) -> bool:
    return not op.startswith(("argmax", "argmin"))


def matmul(
    a_shape: tuple[int, ...],
    a_index: tuple[str, ...],
    b_shape: tuple[int, ...],
    b_index: tuple[str, ...],
    out_shape: tuple[int, ...],
    out_index: tuple[str, ...],
    sizes: dict[str, int],
    dtype: torch.dtype,
    bias: tuple[tuple[int, ...], tuple[str | None, ...]] | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    config: HardwareConfig | None = None,
    name: str | None = None,
    *,
    a_dtype: torch.dtype | None = None,
    b_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    dequant: tuple[str, tuple[int, ...], tuple[str | None, ...], torch.dtype] | None = None,
    scales: tuple[tuple[str, tuple[int, ...], tuple[str | None, ...], torch.dtype], ...] = (),
    planned: bool = True,
) -> Program:
    """``out = alpha * (a @ b) [* scales] [+ beta * bias]`` over named dims.

    ``planned``: the core split, tiles and multicast chosen by the compiler's
    cost-model search (``kernels/plan.py``: an eager matmul is
    modelled as the same matmul compiled alone); False keeps the default
    recipe below (rows and columns by ``default_matmul_split``, no multicast).

    ``sizes`` names every dim: batch dims (``b*``), output rows (``m*``, one or
    more: rows of a reshaped operand stay in its own shape), ``n`` and ``k``.
    Each operand is a whole tensor in its default layout, indexed by the
    names of its host dims (a transposed weight is simply indexed (n, k)).
    Batch dims then rows are split over the cores first, ``n`` in whole
    sticks; ``k`` is streamed through the LX in tiles (the PE array
    accumulates in fp32).

    Operands are ``dtype`` (the activations' type) unless ``a_dtype`` /
    ``b_dtype`` / ``out_dtype`` say otherwise.  Quantised weights:

    * ``dequant=(op, shape, index, dtype)``: ``b`` holds 8-bit weights
      (``b_dtype``), loaded as such (half the bytes of fp16) and dequantised
      in LX by the vector units, ``b_t = op(b_q, ws)`` in ``dtype``, with the
      operand ``ws`` (the weight scale, per tensor or per output channel)
      before the PE array consumes them at the rate of ``dtype`` (W8A16);
    * ``scales``: operands ``(name, shape, index, dtype)`` multiplied into the
      fp32 accumulator in the epilogue, in order (``aten._scaled_mm``'s
      ``scale_a`` and ``scale_b`` of a W8A8 matmul, whose 8-bit ``a`` and
      ``b`` the PE array consumes at its 8-bit rate).
    """
    from torch_spyre.kernels.basic import default_matmul_split, default_matmul_tiles

    cfg = config or HardwareConfig()
    a_dt, b_dt, out_dt = a_dtype or dtype, b_dtype or dtype, out_dtype or dtype
    # tiles and stick splits follow the PE operands' type (the dequantised
    # weight tile, in ``dtype``, takes the LX a double-buffered 16-bit tile
    # would: an 8-bit tile twice plus one 16-bit copy)
    tile_dt = a_dt if b_dt == a_dt else dtype
    se = stick_elems(out_dt)  # n is split over cores in whole output sticks
    batch = [d for d in sizes if d.startswith("b")]
    rows = [d for d in sizes if d.startswith("m")]
    m = math.prod(sizes[d] for d in rows)
    n, k = sizes["n"], sizes["k"]
    nb = math.prod(sizes[d] for d in batch)
    # batch over cores first (independent problems), then the output plane
    pb_total = 1
    split: dict[str, int] = {}
    for d in batch:
        c = max(1, min(sizes[d], cfg.cores // pb_total))
        while cfg.cores // pb_total % c:
            c -= 1
        split[d] = c
        pb_total *= c
    rest = cfg.cores // pb_total
    pm, pn, _ = (
        default_matmul_split(m, n, k, cfg.replace(cores=max(rest, 1)))
        if rest > 1
        else (
            1,
            1,
            1,
        )
    )
    # rows: split the outermost row dim that can take pm
    row_split = next((d for d in rows if sizes[d] >= pm), rows[0] if rows else None)
    if row_split is not None:
        split[row_split] = max(1, min(pm, sizes[row_split]))
    n_chunk = None
    if pn > 1:
        n_chunk = ceil_div(ceil_div(n, pn), se) * se
        pn = ceil_div(n, n_chunk)
        if pn == 1:
            n_chunk = None
    split["n"] = pn
    em = ceil_div(sizes[row_split], split[row_split]) if row_split else 1
    em *= math.prod(sizes[d] for d in rows if d != row_split)
    en = n_chunk or ceil_div(n, pn)
    tm, tn, tk = default_matmul_tiles(em, en, k, tile_dt, True, cfg)
    dims = []
    loop_dims = batch + rows + ["n", "k"]
    for d in loop_dims:
        size = sizes[d]
        cores = split.get(d, 1)
        if d == "n":
            tile = tn
        elif d == "k":
            tile = tk
        elif d == row_split:
            inner = math.prod(sizes[x] for x in rows[rows.index(d) + 1 :])
            tile = max(1, tm // max(inner, 1))
        elif d in rows and rows.index(d) > rows.index(row_split or d):
            tile = size
        else:
            tile = 1
        dims.append(Dim(d, size, cores, tile, n_chunk if d == "n" else None))
    loops = tuple(loop_dims)
    outer = loops[:-1]
    acc_dt = torch.float32
    b_dims = tuple(d for d in loop_dims if d in b_index)
    operands_ = [
        Operand("a", SpyreTensorLayout.default(a_shape, a_dt), "input"),
        Operand("b", SpyreTensorLayout.default(b_shape, b_dt), "input"),
    ]
    buffers = [Buffer("a_t", tuple(d for d in loop_dims if d in a_index), a_dt, True)]
    steps: list = []
    if dequant is None:
        buffers.append(Buffer("b_t", b_dims, b_dt, True))
        steps += [Load("a_t", "a", a_index, loops), Load("b_t", "b", b_index, loops)]
    else:
        op, sshape, sindex, sdt = dequant
        used = tuple(d for d in sindex if d is not None)
        operands_.append(Operand("ws", SpyreTensorLayout.default(sshape, sdt), "input"))
        buffers += [
            Buffer("b_q", b_dims, b_dt, True),
            Buffer("ws_t", tuple(d for d in loop_dims if d in used), sdt, True),
            Buffer("b_t", b_dims, dtype, False),
        ]
        steps += [
            # the scale once per tile of its dims, before the k loop opens
            Load("ws_t", "ws", sindex, _loop_prefix(outer, used)),
            Load("a_t", "a", a_index, loops),
            Load("b_q", "b", b_index, loops),
            Vector(op, "b_t", ("b_q", "ws_t"), (), loops),
        ]
    buffers.append(Buffer("acc", tuple(d for d in loop_dims if d in out_index), acc_dt, True))
    steps.append(Matmul("acc", "a_t", "b_t", loops))
    if alpha != 1.0:
        steps.append(Vector("mul_scalar", "acc", ("acc",), (alpha,), outer))
    for sname, sshape, sindex, sdt in scales:
        used = tuple(d for d in sindex if d is not None)
        operands_.append(Operand(sname, SpyreTensorLayout.default(sshape, sdt), "input"))
        buffers.append(Buffer(f"{sname}_t", tuple(d for d in loop_dims if d in used), sdt, True))
        steps.append(Load(f"{sname}_t", sname, sindex, _loop_prefix(outer, used)))
        steps.append(Vector("mul", "acc", ("acc", f"{sname}_t"), (), outer))
    if bias is not None:
        bshape, bindex = bias
        used = tuple(d for d in bindex if d is not None)
        operands_.append(Operand("bias", SpyreTensorLayout.default(bshape, out_dt), "input"))
        buffers.append(Buffer("bias_t", tuple(d for d in loop_dims if d in used), out_dt, True))
        steps.append(Load("bias_t", "bias", bindex, _loop_prefix(outer, used)))
        if beta != 1.0:
            steps.append(Vector("mul_scalar", "bias_t", ("bias_t",), (beta,), outer))
        steps.append(Vector("add", "acc", ("acc", "bias_t"), (), outer))
    steps.append(Store("out", "acc", out_index, outer))
    operands_.append(Operand("out", SpyreTensorLayout.default(out_shape, out_dt), "output"))
    prog = Program(
        name=name or f"mm_{nb}x{m}x{n}x{k}",
        dims=tuple(dims),
        operands=tuple(operands_),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )
    return _compiler_plan(prog, cfg) if planned else prog


def softmax(
    shape: tuple[int, ...],
    dim: int,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
    log: bool = False,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """(log-)softmax of ``x`` along ``dim``, whole rows in LX (scratchpad-aware:
    exp(x - max) never leaves the LX).  Operands ``x``, ``out``."""
    cfg = config or HardwareConfig()
    shape = tuple(shape) or (1,)
    dim %= len(shape)
    names = [f"d{i}" for i in range(len(shape))]
    r = names[dim]
    kept = tuple(n for n in names if n != r)
    dims, loops, _ = _rowwise_dims(shape, dim, in_dtype, out_dtype, 5, cfg, tile_rows=False)
    idx = tuple(names)
    steps = [
        Load("x_t", "x", idx, loops),
        Reduce("max", "mx", "x_t", r, loops),
        Vector("sub", "e", ("x_t", "mx"), (), loops),
    ]
    if log:
        steps += [
            Vector("exp", "p", ("e",), (), loops),
            Reduce("sum", "s", "p", r, loops),
            Vector("log", "s", ("s",), (), loops),
            Vector("sub", "y", ("e", "s"), (), loops),
        ]
    else:
        steps += [
            Vector("exp", "p", ("e",), (), loops),
            Reduce("sum", "s", "p", r, loops),
            Vector("reciprocal", "s", ("s",), (), loops),
            Vector("mul", "y", ("p", "s"), (), loops),
        ]
    steps.append(Store("out", "y", idx, loops))
    f32 = torch.float32
    return Program(
        name=name or f"{'log_' if log else ''}softmax_{'x'.join(map(str, shape))}",
        dims=tuple(dims),
        operands=(
            Operand("x", SpyreTensorLayout.default(shape, in_dtype), "input"),
            Operand("out", SpyreTensorLayout.default(shape, out_dtype), "output"),
        ),
        buffers=(
            Buffer("x_t", idx, in_dtype, True),
            Buffer("mx", kept, f32),
            Buffer("e", idx, f32),
            Buffer("p", idx, f32),
            Buffer("s", kept, f32),
            Buffer("y", idx, out_dtype, True),
        ),
        steps=tuple(steps),
        loop_order=loops,
    )


def layer_norm(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    eps: float,
    weight: bool,
    bias: bool,
    rms: bool = False,
    config: HardwareConfig | None = None,
    name: str | None = None,
    *,
    planned: bool = True,
) -> Program:
    """Layer norm (or RMS norm) over the last dim of ``x``.

    Operands ``x``, optional ``w`` and ``b`` (last dim), ``out``, and the
    statistics ``mean`` and ``rstd`` (fp32, one per row; no mean for RMS).
    ``planned``: rows split and tiled by the compiler's search (the default
    split puts whole stat sticks, 32 rows, on a core: 8 of 32 cores busy
    for 512 rows); else the fixed recipe.
    """
    cfg = config or HardwareConfig()
    dim = len(shape) - 1
    names = [f"d{i}" for i in range(len(shape))]
    r = names[dim]
    kept = tuple(names[:-1])
    dims, loops, _ = _rowwise_dims(shape, dim, dtype, torch.float32, 7, cfg, tile_rows=False)
    idx = tuple(names)
    n = shape[dim]
    f32 = torch.float32
    steps: list = [Load("x_t", "x", idx, loops)]
    operands_ = [Operand("x", SpyreTensorLayout.default(shape, dtype), "input")]
    # every stored buffer double buffered (as the compiler does): the row
    # loop is then a pipeline, the vector work of one tile hidden under the
    # transfers of the next
    buffers = [
        Buffer("x_t", idx, dtype, True),
        Buffer("rstd", kept, f32, True),
        Buffer("y", idx, f32, True),
    ]
    if rms:
        steps += [Vector("square", "y", ("x_t",), (), loops)]
        src = "x_t"
    else:
        buffers += [Buffer("mean", kept, f32, True), Buffer("xc", idx, f32)]
        steps += [
            Reduce("sum", "mean", "x_t", r, loops),
            Vector("mul_scalar", "mean", ("mean",), (1.0 / n,), loops),
            Vector("sub", "xc", ("x_t", "mean"), (), loops),
            Vector("square", "y", ("xc",), (), loops),
        ]
        src = "xc"
    steps += [
        Reduce("sum", "rstd", "y", r, loops),
        Vector("mul_scalar", "rstd", ("rstd",), (1.0 / n,), loops),
        Vector("add_scalar", "rstd", ("rstd",), (eps,), loops),
        Vector("rsqrt", "rstd", ("rstd",), (), loops),
        Vector("mul", "y", (src, "rstd"), (), loops),
    ]
    for flag, op_name, buf, vop in ((weight, "w", "w_t", "mul"), (bias, "b", "b_t", "add")):
        if flag:
            operands_.append(Operand(op_name, SpyreTensorLayout.default((n,), dtype), "input"))
            buffers.append(Buffer(buf, (r,), f32))
            steps.insert(0, Load(buf, op_name, (r,), ()))
            steps.append(Vector(vop, "y", ("y", buf), (), loops))
    stats_shape = tuple(shape[:-1]) + (1,)
    steps.append(Store("out", "y", idx, loops))
    operands_.append(Operand("out", SpyreTensorLayout.default(shape, dtype), "output"))
    if not rms:
        steps.append(Store("mean", "mean", (*kept, None), loops))
        operands_.append(Operand("mean", SpyreTensorLayout.default(stats_shape, f32), "output"))
    steps.append(Store("rstd", "rstd", (*kept, None), loops))
    operands_.append(Operand("rstd", SpyreTensorLayout.default(stats_shape, f32), "output"))
    prog = Program(
        name=name or f"{'rms' if rms else 'layer'}norm_{'x'.join(map(str, shape))}",
        dims=tuple(dims),
        operands=tuple(operands_),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )
    return _compiler_plan(prog, cfg) if planned else prog
