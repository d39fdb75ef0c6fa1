"""The SwiGLU MLP as one kernel program: two matmuls sharing the activation,
the ``silu(g) * u`` epilogue in LX, and the down projection fed from LX.

``spyre::swiglu_mlp(x, wg, wu, wd)`` = ``F.linear(F.silu(F.linear(x, wg)) *
F.linear(x, wu), wd)`` (nn.Linear weights, no biases) runs
``kernels.basic.best_swiglu_mlp`` on the card.  The spyre post-grad pass
(``compiler/passes.py``) routes that pattern of a compiled graph here; the
eager op is callable directly.

``spyre::swiglu_mlp_add(x, wg, wu, wd, res, scale)`` = ``res + scale *
swiglu_mlp(x, wg, wu, wd)``: a decoder layer's residual add as the epilogue
of the same program (the pass routes ``res + mlp`` and ``res + mlp * c``).

``spyre::swiglu_mlp_norm_add(x, nw, eps, wg, wu, wd, scale)`` = ``x + scale *
swiglu_mlp(rms_norm(x, nw, eps), ...)``: the RMS norm before the MLP as the
program's prologue too (the pass routes a ``swiglu_mlp_add`` whose input is
transformers' ``LlamaRMSNorm`` of its residual).

``spyre::proj_swiglu_mlp_norm_add(a, wo, res, so, nw, eps, wg, wu, wd, scale)``
= ``swiglu_mlp_norm_add(res + so * (a @ wo^T), ...)``: the attention's
output projection and its residual add as the prologue as well, a decoder
layer's whole second half (the pass routes it where the cost model says the
one program beats the projection and the MLP apart).
"""

from __future__ import annotations

import torch

from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("spyre::swiglu_mlp", mutates_args=())
def swiglu_mlp(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> torch.Tensor:
    """(silu(x @ wg^T) * (x @ wu^T)) @ wd^T for x [..., K], wg/wu [N, K], wd [E, N]."""
    if x.device.type == "spyre":
        out = _device_swiglu(x, wg, wu, wd)
        if out is not None:
            return out
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(x, wg)) * f.linear(x, wu), wd)


@swiglu_mlp.register_fake
def _(x, wg, wu, wd):
    return x.new_empty((*x.shape[:-1], wd.shape[0]))


@torch.library.custom_op("spyre::swiglu_mlp_add", mutates_args=())
def swiglu_mlp_add(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    res: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """res + scale * swiglu_mlp(x, wg, wu, wd); res shaped like the output."""
    if x.device.type == "spyre" and res.shape == (*x.shape[:-1], wd.shape[0]):
        if res.dtype == x.dtype:
            out = _device_swiglu(x, wg, wu, wd, res, float(scale))
            if out is not None:
                return out
    return res + swiglu_mlp(x, wg, wu, wd) * scale


@swiglu_mlp_add.register_fake
def _(x, wg, wu, wd, res, scale):
    return x.new_empty((*x.shape[:-1], wd.shape[0]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps))``,
    the statistics in fp32 and the normed rows rounded to ``x``'s dtype."""
    f = x.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype)


@torch.library.custom_op("spyre::swiglu_mlp_norm_add", mutates_args=())
def swiglu_mlp_norm_add(
    x: torch.Tensor,
    nw: torch.Tensor,
    eps: float,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """x + scale * swiglu_mlp(rms_norm(x, nw, eps), wg, wu, wd): a decoder
    layer's second half (norm, MLP, residual add) from its residual stream
    ``x``; the norm is the program's prologue, in LX."""
    if (
        x.device.type == "spyre"
        and nw.shape == (x.shape[-1],)
        and nw.dtype == x.dtype
        and wd.shape[0] == x.shape[-1]
    ):
        out = _device_swiglu(x, wg, wu, wd, x, float(scale), norm=(nw, float(eps)))
        if out is not None:
            return out
    return x + swiglu_mlp(rms_norm(x, nw, eps), wg, wu, wd) * scale


@swiglu_mlp_norm_add.register_fake
def _(x, nw, eps, wg, wu, wd, scale):
    return x.new_empty((*x.shape[:-1], wd.shape[0]))


@torch.library.custom_op("spyre::proj_swiglu_mlp_norm_add", mutates_args=())
def proj_swiglu_mlp_norm_add(
    a: torch.Tensor,
    wo: torch.Tensor,
    res: torch.Tensor,
    so: float,
    nw: torch.Tensor,
    eps: float,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``x = res + so * (a @ wo^T)``, then ``swiglu_mlp_norm_add(x, ...)``: a
    decoder layer's second half from its attention output ``a`` [B, S, J]
    (output projection, residual add, norm, MLP, residual add) in one
    program; the residual stream ``x`` never reaches device memory."""
    if (
        a.device.type == "spyre"
        and a.dim() == 3
        and res.shape == (*a.shape[:-1], wo.shape[0])
        and wo.shape[1] == a.shape[-1]
        and a.dtype == wo.dtype == res.dtype == nw.dtype
        and nw.shape == (res.shape[-1],)
        and wd.shape[0] == res.shape[-1]
    ):
        out = _device_swiglu(
            res, wg, wu, wd, res, float(scale), norm=(nw, float(eps)), proj=(a, wo, float(so))
        )
        if out is not None:
            return out
    x = res + torch.nn.functional.linear(a, wo) * so
    return swiglu_mlp_norm_add(x, nw, eps, wg, wu, wd, scale)


@proj_swiglu_mlp_norm_add.register_fake
def _(a, wo, res, so, nw, eps, wg, wu, wd, scale):
    return res.new_empty(res.shape)


def activation_rows(x: torch.Tensor) -> tuple[int, int, bool, torch.Tensor]:
    """(b, m, batched, whole x) of the activation [..., K] a row-block program
    reads: [B, S, K] in its own layout (no re-layout), anything else as
    [rows, K]."""
    lead = tuple(x.shape[:-1])
    if len(lead) == 2:
        return lead[0], lead[1], True, operands.whole(x)
    m = max(1, x.numel() // x.shape[-1])
    return 1, m, False, operands.whole(x.reshape(m, x.shape[-1]))


def _device_swiglu(x, wg, wu, wd, res=None, scale=None, norm=None, proj=None):
    """``proj=(a, wo, so)`` (with ``norm``): ``x`` is not read; the program
    computes it from ``a``, ``wo`` and the residual ``x`` stands for
    (``swiglu_mlp(proj=)``)."""
    from torch_spyre import kernels

    if x.dtype not in _FLOATS or not (x.dtype == wg.dtype == wu.dtype == wd.dtype):
        return None
    if proj is not None and (x.dim() != 3 or proj[1].dtype != x.dtype):
        return None
    k = x.shape[-1]
    n, e = wg.shape[0], wd.shape[0]
    if wg.shape != (n, k) or wu.shape != (n, k) or wd.shape != (e, n) or x.numel() == 0:
        return None
    wgu = operands.row_blocks([wg, wu])
    lead = tuple(x.shape[:-1])
    b, m, batched, xx = activation_rows(x)
    dev = x.device
    merged = wgu is not None
    eps = None if norm is None else norm[1]
    pj = abase = None
    if proj is not None:
        # the attention output read in place where its bytes are those of
        # [B, S, J] (token-major [B, S, H, D] with D whole sticks) or, one
        # sequence, of [S, J] (a 2-D [T, H * D] or [T, H, D]); else re-laid
        j = proj[0].shape[-1]
        abase = operands.in_shape(proj[0], (b, m, j))
        flat = abase is None and b == 1
        if flat:
            abase = operands.in_shape(proj[0], (m, j))
            flat = abase is not None
        pj = (j, proj[2], flat)
    key = ("swiglu_mlp", b, m, k, n, e, x.dtype, batched, scale, merged, eps, pj)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        p = kernels.best_swiglu_mlp(
            b, m, k, n, e, x.dtype, batched=batched, residual=scale, config=cfg,
            merged=merged, norm_eps=eps, proj=pj,
        )  # fmt: skip
        return launch.Kernel(p)

    try:
        kern = launch.kernel(key, build)
    except Exception:  # no plan fits (e.g. a core's span): the three matmuls run apart
        return None
    if kern.program is None:
        return None
    out = torch.empty((*lead, e), dtype=x.dtype, device=dev)
    if proj is not None:
        a, wo, _ = proj
        first = {
            "a": operands.device_memory(abase)
            if abase is not None
            else operands.memory(a.reshape(b, m, a.shape[-1])),
            "wo": operands.device_memory(operands.whole(wo)),
            "res": operands.device_memory(xx),
        }
    else:
        first = {"x": operands.device_memory(xx)}
    bufs = {
        **first,
        **(
            {"wgu": wgu}
            if merged
            else {
                "wg": operands.device_memory(operands.whole(wg)),
                "wu": operands.device_memory(operands.whole(wu)),
            }
        ),
        "wd": operands.device_memory(operands.whole(wd)),
        "out": operands.device_memory(out),
    }
    if norm is not None:  # the residual is x itself, read again
        bufs["nw"] = operands.device_memory(operands.whole(norm[0]))
    elif res is not None:
        rr = res if batched else res.reshape(m, e)
        bufs["res"] = operands.device_memory(operands.whole(rr))
    kern.launch_memory(dev.index or 0, bufs)
    what = "swiglu_mlp" if res is None else "swiglu_mlp_add"
    if norm is not None:
        what = "swiglu_mlp_norm_add" if proj is None else "proj_swiglu_mlp_norm_add"
    dispatch_stats.record("kernel", what)
    return out
