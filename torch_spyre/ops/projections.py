"""Projections of one activation as one kernel program, optionally behind the
RMS norm that precedes them: an attention block's Q, K and V projections of
the normed residual stream read it once, and the normed rows never reach
device memory.

``spyre::norm_projections(x, nw, eps, ws)`` = ``[F.linear(h, w) for w in ws]``
with ``h = rms_norm(x, nw, eps)`` (``ops/mlp.rms_norm``; ``nw=None``: ``h =
x``), nn.Linear weights without biases.  It runs
``kernels.projections.best_norm_projections`` on the card; the spyre graph
pass routes a norm whose every user is such a projection here
(``compiler/projection_fusion.py``); the eager op is callable directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_spyre.ops.mlp import activation_rows, rms_norm
from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("spyre::norm_projections", mutates_args=())
def norm_projections(
    x: torch.Tensor, nw: torch.Tensor | None, eps: float, ws: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``[x_normed @ w.T for w in ws]``, x [..., K], each w [N_i, K]."""
    if x.device.type == "spyre":
        out = _device_projections(x, nw, float(eps), ws)
        if out is not None:
            return out
    h = x if nw is None else rms_norm(x, nw, eps)
    return [F.linear(h, w) for w in ws]


@norm_projections.register_fake
def _(x, nw, eps, ws):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in ws]


def _device_projections(x, nw, eps: float, ws) -> list[torch.Tensor] | None:
    from torch_spyre.kernels.projections import best_norm_projections, projection_block

    k = x.shape[-1]
    if x.dtype not in _FLOATS or x.numel() == 0 or not ws:
        return None
    if any(w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype for w in ws):
        return None
    if nw is not None and (nw.shape != (k,) or nw.dtype != x.dtype):
        return None
    widths = tuple(int(w.shape[0]) for w in ws)
    if projection_block(widths, x.dtype) is None:
        return None
    lead = tuple(x.shape[:-1])
    b, m, batched, xx = activation_rows(x)
    dev = x.device
    norm_eps = None if nw is None else eps
    key = ("norm_projections", b, m, k, widths, x.dtype, batched, norm_eps)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        p = best_norm_projections(
            b, m, k, widths, x.dtype, norm_eps=norm_eps, batched=batched, config=cfg
        )
        return launch.Kernel(p)

    try:
        kern = launch.kernel(key, build)
    except Exception:  # no plan fits (e.g. a core's span): the matmuls run apart
        return None
    if kern.program is None:
        return None
    outs = [torch.empty((*lead, w), dtype=x.dtype, device=dev) for w in widths]
    bufs = {"x": operands.device_memory(xx)}
    for i, (w, o) in enumerate(zip(ws, outs)):
        bufs[f"w{i}"] = operands.device_memory(operands.whole(w))
        bufs[f"out{i}"] = operands.device_memory(o if batched else o.view(m, widths[i]))
    if nw is not None:
        bufs["nw"] = operands.device_memory(operands.whole(nw))
    kern.launch_memory(dev.index or 0, bufs)
    dispatch_stats.record("kernel", "norm_projections")
    return outs
