"""Casts between the float dtypes (and from bool and int64)."""

from __future__ import annotations

from torch_spyre.tools.fuzz.graph import FLOAT_DTYPES, Invalid
from torch_spyre.tools.fuzz.ops.base import op


def _sample_cast(b):
    x = b.pick(lambda n: n.dtype in ("bool", "int64") or n.bound <= 6e4)
    if x is None:
        return None
    xn = b.g.nodes[x]
    if xn.dtype == "float32":
        to = "float16"
    elif xn.dtype in ("float16", "bool", "int64"):
        to = "float32" if b.rng.random() < 0.8 or xn.dtype == "float16" else "float16"
    else:
        return None
    return "cast", (x,), {"to": to}


@op("cast", 3, _sample_cast, lambda g, n, a: f"{a[0]}.to(torch.{n.attrs['to']})")
def _infer_cast(g, n):
    x = g.nodes[n.args[0]]
    to = n.attrs["to"]
    if to not in FLOAT_DTYPES:
        raise Invalid("cast target")
    if x.dtype == "int64" and x.hi > 2048:
        raise Invalid("int cast beyond float16's integers")
    n.shape, n.dtype, n.lo, n.hi = x.shape, to, x.lo, x.hi
