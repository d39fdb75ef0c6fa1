"""Elementwise losses and GLU as rewrites into pointwise ops and one reduction,
each a kernel program on the card (``ops.adapters``).

PyTorch's CPU kernels compute the same formulas: MSE ``(x - t)^2``,
smooth L1 ``0.5 d^2 / beta if d < beta else d - 0.5 beta`` and Huber
``0.5 d^2 if d < delta else delta (d - 0.5 delta)`` with ``d = |x - t|``,
then no reduction, the mean or the sum.  GLU is ``a * sigmoid(b)`` of the
input's two halves along ``dim``.
"""

from __future__ import annotations

import torch

from torch_spyre.ops.adapters import _spyre_float, adapter


def _reduce(loss: torch.Tensor, reduction: int):
    if reduction == 1:
        return loss.mean()
    if reduction == 2:
        return loss.sum()
    return loss


def _operands(bound):
    x, t = bound["self"], bound["target"]
    if not _spyre_float(x) or not _spyre_float(t) or t.dtype != x.dtype:
        return None
    if x.shape != t.shape or x.numel() == 0:
        return None  # broadcasting losses warn, empty ones give NaN: PyTorch's own rules
    return x, t


@adapter("mse_loss", reason="a squared difference (pointwise) and its mean or sum")
def _mse(op, bound):
    got = _operands(bound)
    if got is None:
        return NotImplemented
    d = got[0] - got[1]
    return _reduce(d * d, int(bound.get("reduction", 1)))


@adapter("smooth_l1_loss", reason="a piecewise pointwise loss and its mean or sum")
def _smooth_l1(op, bound):
    got = _operands(bound)
    if got is None:
        return NotImplemented
    beta = float(bound.get("beta", 1.0))
    d = (got[0] - got[1]).abs()
    if beta == 0:
        loss = d
    else:
        loss = torch.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return _reduce(loss, int(bound.get("reduction", 1)))


@adapter("huber_loss", reason="a piecewise pointwise loss and its mean or sum")
def _huber(op, bound):
    got = _operands(bound)
    if got is None:
        return NotImplemented
    delta = float(bound.get("delta", 1.0))
    d = (got[0] - got[1]).abs()
    loss = torch.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return _reduce(loss, int(bound.get("reduction", 1)))


@adapter("glu", reason="the gated linear unit: one half times the sigmoid of the other")
def _glu(op, bound):
    x = bound["self"]
    dim = int(bound.get("dim", -1))
    if not _spyre_float(x) or x.dim() == 0 or x.shape[dim] % 2:
        return NotImplemented  # PyTorch's error, from the host
    a, b = x.chunk(2, dim)
    return a * torch.sigmoid(b)
