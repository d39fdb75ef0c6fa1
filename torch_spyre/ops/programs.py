"""Kernel programs for eager ops whose shapes the sim's stock builders don't cover:
broadcasting elementwise ops with mixed dtypes, and reductions along one dim.
"""

from __future__ import annotations

import math

import torch

from torch_spyre.layout import SpyreTensorLayout, stick_elems
from torch_spyre.sim import (
    Buffer,
    Dim,
    HardwareConfig,
    Load,
    Operand,
    Program,
    Reduce,
    RingAllReduce,
    Store,
    Vector,
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


def _tiles(shape: list[int], bytes_per_elem: float, budget: int, stick: int) -> list[int]:
    """Tiles that fill ``budget`` bytes of LX, innermost dim first, whole sticks."""
    tiles = [1] * len(shape)
    elems = max(1, int(budget // bytes_per_elem))
    inner = _ceil_div(shape[-1], stick) * stick
    tiles[-1] = shape[-1] if inner <= elems else max(stick, elems // stick * stick)
    acc = _ceil_div(tiles[-1], stick) * stick
    for i in range(len(shape) - 2, -1, -1):
        tiles[i] = max(1, min(shape[i], elems // acc))
        acc *= tiles[i]
    return tiles


def _core_dims(
    shape: tuple[int, ...], dtype_bytes: float, cfg: HardwareConfig, names: list[str], stick: int
) -> tuple[Dim, ...]:
    sd, ncores, chunk = _split(shape, cfg.cores, stick)
    per_core = list(shape)
    per_core[sd] = chunk or _ceil_div(shape[sd], ncores)
    # double-buffered operand tiles in half the LX
    tiles = _tiles(per_core, 2 * dtype_bytes, cfg.lx_bytes // 2, stick)
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
    item = torch.empty((), dtype=out_dtype).element_size()
    in_bytes = sum(torch.empty((), dtype=dt).element_size() for _, dt in inputs)
    # a split of the stick dim must be whole sticks of every operand
    stick = max(stick_elems(dt) for dt in [out_dtype] + [d for _, d in inputs])
    dims = _core_dims(shape, in_bytes + item, cfg, names, stick)
    loops = tuple(names)
    operands, buffers, steps = [], [], []
    for i, (ishape, idt) in enumerate(inputs):
        ishape = tuple(ishape) or (1,)
        lead = len(shape) - len(ishape)
        index = tuple(
            None if (s == 1 and shape[lead + k] != 1) else names[lead + k]
            for k, s in enumerate(ishape)
        )
        if len(ishape) > len(shape) or any(
            s not in (1, shape[lead + k]) for k, s in enumerate(ishape)
        ):
            raise ValueError(f"input {i} of shape {ishape} does not broadcast to {shape}")
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
    item = torch.empty((), dtype=in_dtype).element_size()
    se = stick_elems(in_dtype)
    row = _ceil_div(shape[dim], se) * se * max(item, 4)
    if kept:
        # the last kept dim is the output's stick dim (and the input's, when
        # the reduced dim is not last): split it in whole sticks of both
        ksd, ncores, chunk = _split(kept_shape, cfg.cores, max(se, stick_elems(out_dtype)))
        sd = names.index(kept[ksd])
        per_core = chunk or _ceil_div(shape[sd], ncores)
        rows_budget = max(1, cfg.lx_bytes // 2 // (3 * row))
        dims = []
        for i, (n, s) in enumerate(zip(names, shape)):
            if i == dim:
                dims.append(Dim(n, s))
            elif i == sd:
                dims.append(Dim(n, s, ncores, max(1, min(per_core, rows_budget)), chunk))
            else:
                dims.append(Dim(n, s, 1, 1 if i < sd else s))
        loops = tuple(n for i, n in enumerate(names) if i != dim and i <= sd)
    else:
        ncores = min(cfg.cores, shape[0]) if combinable else 1
        per_core = _ceil_div(shape[0], ncores)
        tile = max(se, min(per_core, cfg.lx_bytes // 4 // max(item, 4) // se * se))
        dims = [Dim(r, shape[0], ncores, tile)]
        loops = ()
    acc = torch.float32 if in_dtype.is_floating_point else out_dtype
    out_shape = kept_shape or (1,)
    steps = [Load("x_t", "x", tuple(names), loops), Reduce(op, "r", "x_t", r, loops)]
    if not kept and ncores > 1:
        steps.append(RingAllReduce("r", r, op, loops))
    if post_scale is not None:
        steps.append(Vector("mul_scalar", "r", ("r",), (post_scale,), loops))
    steps.append(Store("out", "r", tuple(kept) or (None,), loops))
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


def op_keeps_acc(op: str) -> bool:
    return not op.startswith(("argmax", "argmin"))


def numel(shape) -> int:
    return math.prod(shape)
