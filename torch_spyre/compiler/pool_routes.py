"""Pooling in compiled graphs: the eager device programs, through custom ops.

Inductor writes a pooling as a loop over each window's taps inside a
pointwise kernel (max pooling as its low-memory form, the max and the tap's
offset in the window); the planner has no program for a window loop, so the
node would run op by op on the degrade path (hundreds of small kernels for
one max pool's offset arithmetic).  The post-grad pass (``passes.py``)
routes these nodes to custom ops that run the eager device kernels
(``ops/pooling.py``: the window gather (one device copy) and one reduction
program): counted as ``kernel``, never a host fallback.
"""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines the max-pool prim routed below)

from torch_spyre.ops import pooling


@torch.library.custom_op("spyre::max_pool_offsets", mutates_args=())
def max_pool_offsets(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prims._low_memory_max_pool_with_offsets``: the maxima and each one's
    offset in its window (int8, raster order over the kernel)."""
    nd = len(kernel_size)
    xb, added = pooling._batched(x, nd)
    got = pooling.max_windows(xb, nd, kernel_size, stride, padding, dilation, ceil_mode)
    if got is None or x.dtype not in pooling._FLOATS:  # what the prim's aten body does
        vals, offsets = torch.ops.prims._low_memory_max_pool_with_offsets.default(
            x, kernel_size, stride, padding, dilation, ceil_mode
        )
        return vals.contiguous(), offsets.contiguous()
    values, arg = got[0], got[1].to(torch.int8)
    if added:
        values, arg = values.squeeze(0), arg.squeeze(0)
    return values, arg


@max_pool_offsets.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    vals, offsets = torch.ops.prims._low_memory_max_pool_with_offsets.default(
        x, kernel_size, stride, padding, dilation, ceil_mode
    )
    return vals.contiguous(), offsets.contiguous()


def _avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    op = torch.ops.aten.avg_pool2d if len(kernel_size) == 2 else torch.ops.aten.avg_pool3d
    return op.default(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    ).contiguous()


@torch.library.custom_op("spyre::avg_pool", mutates_args=())
def avg_pool(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """``avg_pool2d`` / ``avg_pool3d`` by the device's eager kernel."""
    return _avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@avg_pool.register_fake
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _adaptive_avg(x, output_size):
    op = torch.ops.aten._adaptive_avg_pool2d
    if len(output_size) == 3:
        op = torch.ops.aten._adaptive_avg_pool3d
    return op.default(x, output_size).contiguous()


@torch.library.custom_op("spyre::adaptive_avg_pool", mutates_args=())
def adaptive_avg_pool(x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    """``_adaptive_avg_pool2d`` / ``3d`` by the device's eager kernel."""
    return _adaptive_avg(x, output_size)


@adaptive_avg_pool.register_fake
def _(x, output_size):
    return _adaptive_avg(x, output_size)


def _adaptive_max(x, output_size):
    op = torch.ops.aten.adaptive_max_pool2d
    if len(output_size) == 3:
        op = torch.ops.aten.adaptive_max_pool3d
    values, indices = op.default(x, output_size)
    return values.contiguous(), indices.contiguous()


@torch.library.custom_op("spyre::adaptive_max_pool", mutates_args=())
def adaptive_max_pool(x: torch.Tensor, output_size: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``adaptive_max_pool2d`` / ``3d`` by the device's eager kernel."""
    return _adaptive_max(x, output_size)


@adaptive_max_pool.register_fake
def _(x, output_size):
    return _adaptive_max(x, output_size)


def _ints(v, nd: int, default=None) -> list[int]:
    v = [v] if isinstance(v, int) else list(v or [])
    if not v:
        return list(default)
    return [int(v[0])] * nd if len(v) == 1 else [int(a) for a in v]


def _avg_route(nd: int):
    def route(n: torch.fx.Node):
        args = list(n.args) + [None] * (7 - len(n.args))
        x, k = args[0], _ints(args[1], nd)
        kw = n.kwargs
        stride = _ints(args[2] if args[2] is not None else kw.get("stride", []), nd, k)
        padding = _ints(args[3] if args[3] is not None else kw.get("padding", 0), nd, [0] * nd)
        ceil_mode = bool(args[4] if args[4] is not None else kw.get("ceil_mode", False))
        count = args[5] if args[5] is not None else kw.get("count_include_pad", True)
        div = args[6] if args[6] is not None else kw.get("divisor_override")
        return torch.ops.spyre.avg_pool.default, (x, k, stride, padding, ceil_mode,
                                                  bool(count), div)  # fmt: skip

    return route


def _output_size(n: torch.fx.Node) -> tuple:
    return n.args[0], [int(s) for s in n.args[1]]


_MAX_OFFSETS = torch.ops.prims._low_memory_max_pool_with_offsets.default

#: aten/prims op -> route(node) -> (custom op, args)
ROUTES = {
    _MAX_OFFSETS: lambda n: (
        torch.ops.spyre.max_pool_offsets.default,
        (n.args[0], *[[int(v) for v in a] for a in n.args[1:5]], bool(n.args[5])),
    ),
    torch.ops.aten.avg_pool2d.default: _avg_route(2),
    torch.ops.aten.avg_pool3d.default: _avg_route(3),
    torch.ops.aten._adaptive_avg_pool2d.default: lambda n: (
        torch.ops.spyre.adaptive_avg_pool.default,
        _output_size(n),
    ),
    torch.ops.aten._adaptive_avg_pool3d.default: lambda n: (
        torch.ops.spyre.adaptive_avg_pool.default,
        _output_size(n),
    ),
    torch.ops.aten.adaptive_max_pool2d.default: lambda n: (
        torch.ops.spyre.adaptive_max_pool.default,
        _output_size(n),
    ),
    torch.ops.aten.adaptive_max_pool3d.default: lambda n: (
        torch.ops.spyre.adaptive_max_pool.default,
        _output_size(n),
    ),
}
