"""softmax / log_softmax and layer norm as single kernels (rows stay in LX)."""

from __future__ import annotations

import math

import torch

from torch_spyre.ops import launch, operands, programs
from torch_spyre.ops.registry import NoKernel, kernel

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _softmax(x, dim, half_to_float, log):
    if x.dtype not in _FLOATS:
        raise NoKernel
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)
    shape = tuple(x.shape) or (1,)
    d = dim % len(shape)
    src = operands.base_of(x)
    if src is None or tuple(src.shape) != shape:
        src = operands.whole(x)
    key = ("softmax", log, shape, d, x.dtype, out_dtype)
    k = launch.kernel(
        key, lambda: launch.Kernel(programs.softmax(shape, d, x.dtype, out_dtype, log))
    )
    if k.program is None:
        raise NoKernel
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    k.launch({"x": src.reshape(shape), "out": out.reshape(shape)})
    return out


@kernel("_softmax.default")
def _softmax_k(x, dim, half_to_float):
    return _softmax(x, dim, half_to_float, log=False)


@kernel("_log_softmax.default")
def _log_softmax_k(x, dim, half_to_float):
    return _softmax(x, dim, half_to_float, log=True)


@kernel("native_layer_norm.default")
def _layer_norm(x, normalized_shape, weight, bias, eps):
    if x.dtype not in _FLOATS:
        raise NoKernel
    nd = len(normalized_shape)
    n = math.prod(normalized_shape)
    lead = tuple(x.shape[: x.dim() - nd])
    if x.numel() == 0:
        if n == 0:
            raise NoKernel  # statistics of empty rows: PyTorch's NaN rules
        stats = torch.empty((*lead, *([1] * nd)), dtype=x.dtype, device=x.device)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), stats, stats.clone()
    shape = (*lead, n) if lead else (1, n)
    for p in (weight, bias):
        if p is not None and p.dtype != x.dtype:
            raise NoKernel
    src = operands.whole(x).reshape(shape)
    if nd > 1:  # several normalised dims: one flattened row (a re-layout)
        src = operands.whole(src)
    key = ("layer_norm", shape, x.dtype, float(eps), weight is not None, bias is not None)
    k = launch.kernel(
        key,
        lambda: launch.Kernel(
            programs.layer_norm(shape, x.dtype, float(eps), weight is not None, bias is not None)
        ),
    )
    if k.program is None:
        raise NoKernel
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    stats = (*shape[:-1], 1)
    mean = torch.empty(stats, dtype=torch.float32, device=x.device)
    rstd = torch.empty(stats, dtype=torch.float32, device=x.device)
    bind = {"x": src, "out": out, "mean": mean, "rstd": rstd}
    if weight is not None:
        bind["w"] = operands.whole(weight.reshape(n))
    if bias is not None:
        bind["b"] = operands.whole(bias.reshape(n))
    k.launch(bind)
    stat_shape = (*lead, *([1] * nd))
    # computed in fp32 on the card; returned in the input's dtype, as the CPU does
    mean = mean.view(stat_shape).to(x.dtype)
    rstd = rstd.view(stat_shape).to(x.dtype)
    return out.view(x.shape), mean, rstd
