"""transformers' ``LlamaRMSNorm`` in a post-grad FX graph: what the fused
programs that take a norm as their prologue match (``mlp_fusion``: the MLP
after it; ``projection_fusion``: the Q, K, V projections after it)."""

from __future__ import annotations

import torch

from torch_spyre.compiler.fx_match import is_op as _is


def _val(w):
    return w.meta.get("val") if isinstance(w, torch.fx.Node) else None


def _scalar_operand(node, op: str):
    """(tensor node, number) of a binary ``op`` with one tensor and one number; else None."""
    if not _is(node, op) or len(node.args) != 2 or node.kwargs:
        return None
    t = [a for a in node.args if isinstance(a, torch.fx.Node)]
    c = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return (t[0], float(c[0])) if len(t) == 1 and len(c) == 1 else None


def _cast_of(node, dtype: torch.dtype):
    """x when ``node`` is ``x.to(dtype)`` (``prims.convert_element_type``); else None."""
    if (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target is torch.ops.prims.convert_element_type.default
        and node.args[1] == dtype
    ):
        return node.args[0]
    return None


def rms_norm_of(node, seen: list):
    """(x, weight, eps) when ``node`` is transformers' ``LlamaRMSNorm`` of ``x``:
    ``weight * (f * rsqrt(mean(f^2, -1) + eps)).to(x.dtype)`` with ``f =
    x.to(float32)`` (no casts for an fp32 ``x``); the nodes between are
    appended to ``seen``.  Norms that scale in fp32 before the cast (Gemma's
    ``1 + weight``) are another computation and do not match."""
    if not _is(node, "mul") or len(node.args) != 2 or node.kwargs:
        return None
    for w, y in (node.args, node.args[::-1]):
        wv, yv = _val(w) if isinstance(w, torch.fx.Node) else None, node.meta.get("val")
        if not isinstance(wv, torch.Tensor) or not isinstance(yv, torch.Tensor) or wv.dim() != 1:
            continue
        dt = yv.dtype
        prod = y if dt == torch.float32 else _cast_of(y, dt)
        if not _is(prod, "mul") or len(prod.args) != 2:
            continue
        for f, r in (prod.args, prod.args[::-1]):
            x = f if dt == torch.float32 else _cast_of(f, torch.float32)
            if not _is(r, "rsqrt") or x is None:
                continue
            added = _scalar_operand(r.args[0], "add")
            if added is None or not _is(added[0], "mean"):
                continue
            mean, eps = added
            sq = mean.args[0]
            dims = list(mean.args[1]) if len(mean.args) > 1 else []
            keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
            xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if not isinstance(xv, torch.Tensor) or xv.dtype != dt or not keep:
                continue
            if [d % xv.dim() for d in dims] != [xv.dim() - 1] or wv.shape[0] != xv.shape[-1]:
                continue
            squares = (_is(sq, "pow") and sq.args[0] is f and sq.args[1] == 2) or (
                _is(sq, "mul") and list(sq.args) == [f, f]
            )
            if not squares:
                continue
            seen += [n for n in (node, y, prod, f, r, r.args[0], mean, sq) if n is not x]
            return x, w, eps
    return None
