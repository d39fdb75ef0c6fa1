"""Contractions: ``matmul`` and ``conv``."""

from __future__ import annotations

import math

from torch_spyre.tools.fuzz.graph import Invalid
from torch_spyre.tools.fuzz.ops.base import MAX_BOUND, _broadcast, _interval_mul, _same_float, op
from torch_spyre.tools.fuzz.ops.views import _divisors


def _sample_matmul(b):
    x = b.pick_float(lambda n: n.bound <= 50 and (len(n.shape) >= 2 or True))
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    kind = b.rng.choice(["matmul", "matmul", "linear", "bmm"])
    if kind == "bmm" and rank != 3:
        kind = "matmul"
    k = xn.shape[-1]
    wb = 1 / math.sqrt(k)
    if kind == "linear":
        w = b.new_float([b.size(), [x, -1]], -wb, wb, dtype=xn.dtype, layout_ok=True)
        args = [x, w]
        if b.rng.random() < 0.5:
            args.append(b.new_float([[w, 0]], -0.5, 0.5, dtype=xn.dtype))
        return "matmul", tuple(args), {"kind": "linear"}
    # the other operand: an existing node with matching dims, or a new weight
    if rank >= 2:

        def fits(n, xn=xn):
            if n.dtype != xn.dtype or len(n.shape) < 2 or n.bound > 50:
                return False
            if n.shape[-2] != xn.shape[-1]:
                return False
            if kind == "bmm":
                return len(n.shape) == 3 and n.shape[0] == xn.shape[0]
            try:
                _broadcast(n.shape[:-2], xn.shape[:-2])
                return True
            except Invalid:
                return False

        y = b.pick_float(fits, exclude=x)
    else:
        y = None
    if y is None or b.rng.random() < 0.5:
        batch = [[x, i] for i in range(rank - 2)] if kind == "bmm" or b.rng.random() < 0.3 else []
        y = b.new_float([*batch, [x, -1], b.size()], -wb, wb, dtype=xn.dtype, layout_ok=True)
    return "matmul", (x, y), {"kind": kind}


def _code_matmul(g, n, a):
    k = n.attrs["kind"]
    if k == "linear":
        return f"F.linear({', '.join(a)})"
    if k == "bmm":
        return f"torch.bmm({a[0]}, {a[1]})"
    return f"{a[0]} @ {a[1]}"


@op("matmul", 6, _sample_matmul, _code_matmul)
def _infer_matmul(g, n):
    x, w = _same_float(g, n, 0), _same_float(g, n, 1)
    k = n.attrs["kind"]
    if x.dtype != w.dtype:
        raise Invalid("matmul dtypes")
    if k == "linear":
        if len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
            raise Invalid("linear weight")
        n.shape = (*x.shape[:-1], w.shape[0])
        kk = x.shape[-1]
    elif k == "bmm":
        if (
            len(x.shape) != 3
            or len(w.shape) != 3
            or x.shape[0] != w.shape[0]
            or x.shape[2] != w.shape[1]
        ):
            raise Invalid("bmm shapes")
        n.shape, kk = (x.shape[0], x.shape[1], w.shape[2]), x.shape[2]
    else:
        xs, ws = list(x.shape), list(w.shape)
        if len(ws) == 1:
            raise Invalid("matmul with a vector")
        kk = xs[-1]
        if ws[-2] != kk:
            raise Invalid("matmul k")
        if len(xs) == 1:
            n.shape = (*ws[:-2], ws[-1])
        else:
            n.shape = (*_broadcast(tuple(xs[:-2]), tuple(ws[:-2])), xs[-2], ws[-1])
    n.dtype, n.acc = x.dtype, kk
    lo, hi = _interval_mul(x, w)
    n.lo, n.hi = kk * lo, kk * hi
    if len(n.args) > 2:
        bias = g.nodes[n.args[2]]
        if bias.shape != (w.shape[0],) or bias.dtype != x.dtype:
            raise Invalid("linear bias")
        n.lo, n.hi = n.lo + bias.lo, n.hi + bias.hi
    # a product's range is the interval bound, far beyond the typical values
    n.lo, n.hi = max(n.lo, -MAX_BOUND), min(n.hi, MAX_BOUND)
    if max(x.bound, w.bound) * max(x.bound, w.bound) * kk > 50 * MAX_BOUND:
        raise Invalid("matmul magnitude")


def _sample_conv(b):
    x = b.pick_float(lambda n: len(n.shape) in (3, 4) and n.bound <= 50)
    if x is None:
        return None
    xn = b.g.nodes[x]
    nd = len(xn.shape) - 2
    c = xn.shape[1]
    kind = b.rng.choice(["conv", "conv", "maxpool", "avgpool"])
    ksize = b.rng.choice([1, 2, 3, 3, 4])
    stride = b.rng.choice([1, 1, 2])
    pad = b.rng.randint(0, ksize // 2)
    a = {"kind": kind, "nd": nd, "k": ksize, "stride": stride, "pad": pad}
    if kind != "conv":
        return "conv", (x,), a
    a["dilation"] = b.rng.choice([1, 1, 2])
    groups = b.rng.choice([1, 1, c] + [d for d in _divisors(c)][:2])
    a["groups"] = groups
    cout = groups * b.rng.choice([1, 2]) if groups > 1 else b.size()
    wb = 1 / math.sqrt(max(1, (c // groups) * ksize**nd))
    w = b.new_float([cout, c // groups, *([ksize] * nd)], -wb, wb, dtype=xn.dtype)
    args = [x, w]
    if b.rng.random() < 0.5:
        args.append(b.new_float([[w, 0]], -0.5, 0.5, dtype=xn.dtype))
    return "conv", tuple(args), a


def _code_conv(g, n, a):
    at = n.attrs
    nd = at["nd"]
    if at["kind"] == "maxpool":
        return f"F.max_pool{nd}d({a[0]}, {at['k']}, {at['stride']}, {at['pad']})"
    if at["kind"] == "avgpool":
        return f"F.avg_pool{nd}d({a[0]}, {at['k']}, {at['stride']}, {at['pad']})"
    bias = a[2] if len(a) > 2 else "None"
    return (
        f"F.conv{nd}d({a[0]}, {a[1]}, {bias}, stride={at['stride']}, padding={at['pad']}, "
        f"dilation={at['dilation']}, groups={at['groups']})"
    )


@op("conv", 4, _sample_conv, _code_conv)
def _infer_conv(g, n):
    x = _same_float(g, n)
    at = n.attrs
    nd = at["nd"]
    if len(x.shape) != nd + 2:
        raise Invalid("conv rank")
    k, st, p = at["k"], at["stride"], at["pad"]
    dil = at.get("dilation", 1)
    if p > k // 2:
        raise Invalid("pad wider than half the kernel")
    spatial = []
    for s in x.shape[2:]:
        o = (s + 2 * p - dil * (k - 1) - 1) // st + 1
        if o < 1:
            raise Invalid("conv output empty")
        spatial.append(o)
    n.dtype = x.dtype
    if at["kind"] != "conv":
        n.shape = (*x.shape[:2], *spatial)
        n.lo, n.hi = x.lo, x.hi
        if at["kind"] == "avgpool":
            n.acc = k**nd
            n.lo, n.hi = min(x.lo, 0.0), max(x.hi, 0.0)  # zero padding is averaged in
        return
    w = g.nodes[n.args[1]]
    groups = at["groups"]
    c = x.shape[1]
    if w.dtype != x.dtype or len(w.shape) != nd + 2 or c % groups or w.shape[1] != c // groups:
        raise Invalid("conv weight")
    if w.shape[0] % groups or any(s != k for s in w.shape[2:]):
        raise Invalid("conv weight shape")
    n.shape = (x.shape[0], w.shape[0], *spatial)
    n.acc = (c // groups) * k**nd
    lo, hi = _interval_mul(x, w)
    n.lo, n.hi = n.acc * min(lo, 0), n.acc * max(hi, 0)
    if len(n.args) > 2:
        bias = g.nodes[n.args[2]]
        if bias.shape != (w.shape[0],) or bias.dtype != x.dtype:
            raise Invalid("conv bias")
        n.lo, n.hi = n.lo + bias.lo, n.hi + bias.hi
    n.lo, n.hi = max(n.lo, -MAX_BOUND), min(n.hi, MAX_BOUND)
