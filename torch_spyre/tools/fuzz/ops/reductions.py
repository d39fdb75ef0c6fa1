"""Reductions, softmax and norms."""

from __future__ import annotations

import math

from torch_spyre.tools.fuzz.graph import Invalid
from torch_spyre.tools.fuzz.ops.base import _interval_mul, _norm_dim, _same_float, op

REDUCE = {
    "sum": "{x}.sum({d}, keepdim={k})",
    "mean": "{x}.mean({d}, keepdim={k})",
    "amax": "{x}.amax({d}, keepdim={k})",
    "amin": "{x}.amin({d}, keepdim={k})",
    "var": "{x}.var({d}, keepdim={k}, unbiased=False)",
    "std": "{x}.std({d}, keepdim={k})",
    "logsumexp": "torch.logsumexp({x}, {d}, keepdim={k})",
    "norm": "torch.linalg.vector_norm({x}, 2, {d}, keepdim={k})",
    "prod": "{x}.prod({d[0]}, keepdim={k})",
    "max_values": "{x}.max({d[0]}, keepdim={k}).values",
    "argmax": "{x}.argmax({d[0]}, keepdim={k})",
    "argmin": "{x}.argmin({d[0]}, keepdim={k})",
}
_SINGLE_DIM = ("prod", "max_values", "argmax", "argmin")


def _sample_reduce(b):
    f = b.rng.choice(list(REDUCE))
    if f in ("argmax", "argmin"):
        # an arg of computed values flips with the last bit: inputs only
        x = b.pick(
            lambda n: (
                n.op == "input"
                and n.attrs["kind"] == "float"
                and n.attrs.get("layout") != "expanded"
            )
        )
    elif f == "prod":
        x = b.pick_float(lambda n: n.lo >= 0.5 and n.hi <= 1.5)
    elif f == "logsumexp":
        x = b.pick_float(lambda n: n.hi <= 30)
    else:
        x = b.pick_float()
    if x is None:
        return None
    rank = len(b.g.nodes[x].shape)
    if f in _SINGLE_DIM or rank == 1 or b.rng.random() < 0.7:
        dims = [b.rng.randrange(rank) - (rank if b.rng.random() < 0.5 else 0)]
    else:
        dims = sorted(b.rng.sample(range(rank), b.rng.randint(2, rank)))
    return "reduce", (x,), {"f": f, "dims": dims, "keepdim": b.rng.random() < 0.5}


def _code_reduce(g, n, a):
    d = n.attrs["dims"]
    return REDUCE[n.attrs["f"]].format(x=a[0], d=d if len(d) > 1 else d, k=n.attrs["keepdim"])


@op("reduce", 8, _sample_reduce, _code_reduce)
def _infer_reduce(g, n):
    x = _same_float(g, n)
    f, keep = n.attrs["f"], n.attrs["keepdim"]
    rank = len(x.shape)
    dims = sorted({_norm_dim(d, rank) for d in n.attrs["dims"]})
    if len(dims) != len(n.attrs["dims"]) or (f in _SINGLE_DIM and len(dims) != 1):
        raise Invalid("reduction dims")
    cnt = math.prod(x.shape[d] for d in dims)
    n.shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape) if keep or i not in dims)
    n.acc = cnt
    n.dtype = x.dtype
    lo, hi = x.lo, x.hi
    if f == "sum":
        n.lo, n.hi = cnt * lo, cnt * hi
    elif f in ("mean", "amax", "amin", "max_values"):
        n.lo, n.hi = lo, hi
    elif f == "var":
        n.lo, n.hi = 0.0, (hi - lo) ** 2
    elif f == "std":
        if cnt < 2:
            raise Invalid("std of one element")
        n.lo, n.hi = 0.0, (hi - lo) * math.sqrt(cnt / (cnt - 1))
    elif f == "logsumexp":
        if hi > 30:
            raise Invalid("logsumexp range")
        n.lo, n.hi = lo, hi + math.log(cnt)
    elif f == "norm":
        n.lo, n.hi = 0.0, math.sqrt(cnt) * max(abs(lo), abs(hi))
    elif f == "prod":
        if not (lo >= 0.5 and hi <= 1.5) or cnt > 16:
            raise Invalid("prod range")
        n.lo, n.hi = lo**cnt, hi**cnt
    else:  # argmax / argmin
        if not (
            x.op == "input" and x.attrs["kind"] == "float" and x.attrs.get("layout") != "expanded"
        ):
            raise Invalid("arg reduction of a computed value")
        n.dtype, n.lo, n.hi = "int64", 0.0, float(cnt - 1)


# ---- softmax and norms -------------------------------------------------------------------


def _sample_softmax(b):
    x = b.pick_float()
    if x is None:
        return None
    rank = len(b.g.nodes[x].shape)
    dim = b.rng.choice([-1, -1, b.rng.randrange(rank)])
    return "softmax", (x,), {"log": b.rng.random() < 0.3, "dim": dim}


def _code_softmax(g, n, a):
    f = "log_softmax" if n.attrs["log"] else "softmax"
    return f"F.{f}({a[0]}, dim={n.attrs['dim']})"


@op("softmax", 4, _sample_softmax, _code_softmax)
def _infer_softmax(g, n):
    x = _same_float(g, n)
    d = _norm_dim(n.attrs["dim"], len(x.shape))
    n.shape, n.dtype, n.acc = x.shape, x.dtype, x.shape[d]
    if n.attrs["log"]:
        n.lo, n.hi = x.lo - x.hi - math.log(x.shape[d]), 0.0
    else:
        n.lo, n.hi = 0.0, 1.0


def _sample_norm(b):
    x = b.pick_float(lambda n: n.shape[-1] > 1)
    if x is None:
        return None
    xn = b.g.nodes[x]
    kind = b.rng.choice(["layer", "rms", "rms_manual"])
    k = 1 if len(xn.shape) == 1 or b.rng.random() < 0.8 else 2
    affine = b.rng.random() < 0.7
    args = [x]
    tail = [[x, d] for d in range(len(xn.shape) - k, len(xn.shape))]
    if affine:
        args.append(b.new_float(tail, 0.5, 1.5, dtype=xn.dtype))
        if kind == "layer" and b.rng.random() < 0.7:
            args.append(b.new_float(tail, -0.5, 0.5, dtype=xn.dtype))
    return "norm", tuple(args), {"kind": kind, "k": k}


def _code_norm(g, n, a):
    x = g.nodes[n.args[0]]
    k = n.attrs["k"]
    shape = tuple(x.shape[-k:])
    w = a[1] if len(a) > 1 else "None"
    if n.attrs["kind"] == "layer":
        bias = a[2] if len(a) > 2 else "None"
        return f"F.layer_norm({a[0]}, {shape}, {w}, {bias}, 1e-5)"
    if n.attrs["kind"] == "rms":
        return f"F.rms_norm({a[0]}, {shape}, {w}, 1e-6)"
    dims = list(range(-k, 0))
    expr = f"({a[0]} * torch.rsqrt({a[0]}.pow(2).mean({dims}, keepdim=True) + 1e-6))"
    return f"{expr} * {w}" if len(a) > 1 else expr


@op("norm", 4, _sample_norm, _code_norm)
def _infer_norm(g, n):
    x = _same_float(g, n)
    k = n.attrs["k"]
    if not 1 <= k <= len(x.shape):
        raise Invalid("norm dims")
    cnt = math.prod(x.shape[-k:])
    if cnt < 2:
        raise Invalid("norm of one element")
    bound = math.sqrt(cnt)
    if n.attrs["kind"] != "layer":
        bound = min(bound, x.bound * 1e3)
    wlo, whi = -bound, bound
    for j, p in enumerate(n.args[1:], 1):
        pn = g.nodes[p]
        if pn.shape != x.shape[-k:] or pn.dtype != x.dtype:
            raise Invalid("norm parameter shape")
        if j == 1:
            wlo, whi = _interval_mul((wlo, whi), pn)
        else:
            wlo, whi = wlo + pn.lo, whi + pn.hi
    if n.attrs["kind"] != "layer" and len(n.args) > 2:
        raise Invalid("rms norm with a bias")
    n.shape, n.dtype, n.acc = x.shape, x.dtype, cnt
    n.lo, n.hi = wlo, whi
