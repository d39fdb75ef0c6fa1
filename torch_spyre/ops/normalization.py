"""softmax / log_softmax, layer norm and RMS norm as single kernels (rows stay in LX)."""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

from torch_spyre.kernels import eager as programs
from torch_spyre.ops.registry import NoKernel, kernel
from torch_spyre.runtime import launch, operands

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


def _row_norm(x, normalized_shape, weight, bias, eps: float, rms: bool):
    """Layer norm (``rms``: RMS norm) of ``x`` over its last ``normalized_shape``
    dims as one kernel: each row is read once into LX, its statistics and the
    normalised row computed there, the row stored once.  Returns ``out`` (x's
    shape), ``mean`` (None for RMS) and ``rstd``, fp32 of shape
    ``lead + [1] * len(normalized_shape)``."""
    if x.dtype not in _FLOATS:
        raise NoKernel
    nd = len(normalized_shape)
    n = math.prod(normalized_shape)
    lead = tuple(x.shape[: x.dim() - nd])
    stat_shape = (*lead, *([1] * nd))
    if x.numel() == 0:
        if n == 0:
            raise NoKernel  # statistics of empty rows: PyTorch's NaN rules
        stats = torch.empty(stat_shape, dtype=torch.float32, device=x.device)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return out, (None if rms else stats.clone()), stats
    shape = (*lead, n) if lead else (1, n)
    for p in (weight, bias):
        if p is not None and p.dtype != x.dtype:
            raise NoKernel
    src = operands.whole(x).reshape(shape)
    if nd > 1:  # several normalised dims: one flattened row (a re-layout)
        src = operands.whole(src)
    has_w, has_b = weight is not None, bias is not None
    key = ("rms_norm" if rms else "layer_norm", shape, x.dtype, eps, has_w, has_b)
    k = launch.kernel(
        key, lambda: launch.Kernel(programs.layer_norm(shape, x.dtype, eps, has_w, has_b, rms))
    )
    if k.program is None:
        raise NoKernel
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    stats = (*shape[:-1], 1)
    rstd = torch.empty(stats, dtype=torch.float32, device=x.device)
    bind = {"x": src, "out": out, "rstd": rstd}
    mean = None
    if not rms:
        mean = bind["mean"] = torch.empty(stats, dtype=torch.float32, device=x.device)
    if has_w:
        bind["w"] = operands.whole(weight.reshape(n))
    if has_b:
        bind["b"] = operands.whole(bias.reshape(n))
    k.launch(bind)
    if mean is not None:
        mean = mean.view(stat_shape)
    return out.view(x.shape), mean, rstd.view(stat_shape)


@kernel("native_layer_norm.default")
def _layer_norm(x, normalized_shape, weight, bias, eps):
    out, mean, rstd = _row_norm(x, normalized_shape, weight, bias, float(eps), rms=False)
    # computed in fp32 on the card; returned in the input's dtype, as the CPU does
    return out, mean.to(x.dtype), rstd.to(x.dtype)


def _rms_eps(eps) -> float:
    # PyTorch's default: the machine epsilon of the fp32 accumulation type
    return float(eps) if eps is not None else torch.finfo(torch.float32).eps


# torch 2.13's ``aten::rms_norm`` composite calls ``_fused_rms_norm`` on a
# backend that has a kernel for it (else it splits the op into pow, mean,
# add, rsqrt and mul: the row read from device memory five times)
@kernel("_fused_rms_norm.default")
def _fused_rms_norm(x, normalized_shape, weight, eps):
    try:
        out, _, rstd = _row_norm(x, normalized_shape, weight, None, _rms_eps(eps), rms=True)
    except NoKernel:  # e.g. a row longer than the LX: op by op on the card, as before
        return _RMS_FORWARD(x, normalized_shape, weight, eps)
    return out, rstd  # rstd in fp32, as PyTorch's fused kernels return it


@kernel("_fused_rms_norm_backward.default")
def _fused_rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, output_mask):
    # PyTorch's own formula (its decomposition), each op an eager kernel on
    # the card: PyTorch ships no kernel of this op for a backend without one
    return _RMS_BACKWARD(grad_out, x, normalized_shape, rstd, weight, output_mask)


_RMS_FORWARD = decomposition_table[torch.ops.aten._fused_rms_norm.default]
_RMS_BACKWARD = decomposition_table[torch.ops.aten._fused_rms_norm_backward.default]


# ----------------------------------------------------------------- batch norm
def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm (instance norm runs as one over [1, N*C, ...]) on the card.

    Training: the batch statistics are one ``var_mean`` reduction program
    over every dim but the channels; the running statistics are updated in
    place (PyTorch's rule: the unbiased variance).  Then, as PyTorch's CPU
    kernel does, the per-channel affine ``alpha = weight * invstd``,
    ``beta = bias - mean * alpha`` (vectors of C), and one pointwise pass
    ``out = x * alpha + beta`` over the input."""
    if x.dtype not in _FLOATS or x.dim() < 2 or x.numel() == 0:
        raise NoKernel
    for t in (weight, bias, running_mean, running_var):
        if t is not None and t.dtype != x.dtype:
            raise NoKernel
    c = x.shape[1]
    if training:
        dims = [0, *range(2, x.dim())]
        n = x.numel() // c
        var, mean = torch.var_mean(x, dims, correction=0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        if running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        save_mean, save_invstd = mean, invstd
    else:
        if running_mean is None or running_var is None:
            raise NoKernel
        mean, invstd = running_mean, torch.rsqrt(running_var + eps)
        save_mean = torch.empty(0, dtype=x.dtype, device=x.device)
        save_invstd = torch.empty(0, dtype=x.dtype, device=x.device)
    alpha = invstd if weight is None else invstd * weight
    beta = -mean * alpha if bias is None else bias - mean * alpha
    shape = (c, *([1] * (x.dim() - 2)))
    out = torch.addcmul(beta.view(shape), x, alpha.view(shape))
    return out, save_mean, save_invstd


@kernel("native_batch_norm.default")
def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(
        x, weight, bias, running_mean, running_var, training, float(momentum), float(eps)
    )


@kernel("_native_batch_norm_legit_no_training.default")
def _batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm(x, weight, bias, running_mean, running_var, False, float(momentum),
                      float(eps))  # fmt: skip


@kernel("_native_batch_norm_legit.default")
def _batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(x, weight, bias, running_mean, running_var, training, float(momentum),
                      float(eps))  # fmt: skip


@kernel("_native_batch_norm_legit.no_stats")
def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    return batch_norm(x, weight, bias, None, None, training, float(momentum), float(eps))
