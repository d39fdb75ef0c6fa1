"""Losses (elementwise, NLL, BCE) and GLU as rewrites into pointwise ops,
gathers and reductions, each a kernel program on the card (``ops.adapters``).

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


# ----------------------------------------------------------------- NLL and BCE
def _nll(op, bound):
    """``nll_loss_forward`` / ``nll_loss2d_forward``: (loss, total weight), as
    PyTorch's CPU kernels define them: each sample's ``-x[target]`` times its
    class weight, an ignored target counting neither loss nor weight; the
    mean divides by the total weight."""
    x, target = bound["self"], bound["target"]
    weight, reduction = bound.get("weight"), int(bound.get("reduction", 1))
    ignore = int(bound.get("ignore_index", -100))
    if not _spyre_float(x) or not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        return NotImplemented
    if target.device != x.device or (weight is not None and not _spyre_float(weight)):
        return NotImplemented
    single = x.dim() == 1
    if single:
        x, target = x.unsqueeze(0), target.unsqueeze(0)
    if x.dim() < 2 or x.shape[0] != target.shape[0] or target.shape[1:] != x.shape[2:]:
        return NotImplemented  # PyTorch's shape errors, from the host
    if x.numel() == 0 or target.numel() == 0:
        return NotImplemented
    keep = target != ignore
    safe = torch.where(keep, target, torch.zeros_like(target))
    bad = (safe < 0) | (safe >= x.shape[1])
    if bool(bad.any()):  # PyTorch's error, naming the first bad target
        raise IndexError(f"Target {int(safe[bad][0])} is out of bounds.")
    picked = -torch.gather(x, 1, safe.unsqueeze(1)).squeeze(1)
    w = keep.to(x.dtype)
    if weight is not None:
        w = w * weight.index_select(0, safe.reshape(-1)).view(safe.shape)
    losses = torch.where(keep, picked * w, torch.zeros_like(picked))
    if reduction == 0:
        total = torch.zeros((), dtype=x.dtype, device=x.device)
        return (losses.squeeze(0) if single else losses), total
    total, summed = w.sum(), losses.sum()
    return (summed / total if reduction == 1 else summed), total


adapter("nll_loss_forward", "nll_loss2d_forward",
        reason="negative log likelihood: a gather of the targets' log-probabilities, "
               "their class weights, and a weighted sum")(_nll)  # fmt: skip


@adapter("binary_cross_entropy", reason="pointwise logs (clamped at -100) and a mean or sum")
def _bce(op, bound):
    x, t = bound["self"], bound["target"]
    weight, reduction = bound.get("weight"), int(bound.get("reduction", 1))
    if not _spyre_float(x) or not _spyre_float(t) or t.dtype != x.dtype or x.shape != t.shape:
        return NotImplemented
    if x.numel() == 0 or (weight is not None and not _spyre_float(weight)):
        return NotImplemented
    if bool(((x < 0) | (x > 1)).any()):
        raise RuntimeError("all elements of input should be between 0 and 1")
    # PyTorch's CPU kernel: (t - 1) * max(log1p(-x), -100) - t * max(log(x), -100)
    loss = (t - 1) * torch.clamp(torch.log1p(-x), min=-100) - t * torch.clamp(
        torch.log(x), min=-100
    )
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)
