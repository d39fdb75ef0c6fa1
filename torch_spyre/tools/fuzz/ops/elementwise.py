"""Element-wise ops: unary, binary (with broadcasting) and masks (``where``,
``masked_fill``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch_spyre.tools.fuzz.graph import Invalid, Node
from torch_spyre.tools.fuzz.ops.base import _broadcast, _interval_mul, _promote, _same_float, op


def _sig(x: float) -> float:
    # 1 / (1 + exp(-x)) overflows exp for x below -709 (a value range of a long
    # chain); tanh never does (it crashed the fuzzer's worker: seed 703280)
    return 0.5 * (1.0 + math.tanh(x / 2.0))


@dataclass
class Unary:
    template: str  # "{x}" is the operand
    rng: Callable[[float, float], tuple[float, float]]
    ok: Callable[[float, float], bool] = lambda lo, hi: True


def _silu_rng(lo, hi):
    return (-0.2785, max(hi, 0.0)) if lo < 0 else (lo * _sig(lo), hi * _sig(hi))


def _gelu_rng(lo, hi):
    return (-0.17, max(hi, 0.0)) if lo < 0 else (lo * 0.5, hi)


def _away(lim: float) -> Callable[[float, float], bool]:
    return lambda lo, hi: lo >= lim or hi <= -lim


def _mono(f):
    return lambda lo, hi: (f(lo), f(hi))


def _sq(lo, hi):
    m = max(lo * lo, hi * hi)
    return (0.0 if lo <= 0 <= hi else min(lo * lo, hi * hi), m)


UNARY: dict[str, Unary] = {
    "neg": Unary("-{x}", lambda lo, hi: (-hi, -lo)),
    "abs": Unary(
        "{x}.abs()",
        lambda lo, hi: (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi))),
    ),
    "exp": Unary("torch.exp({x})", _mono(math.exp), lambda lo, hi: hi <= 5),
    "tanh": Unary("torch.tanh({x})", _mono(math.tanh)),
    "sigmoid": Unary("torch.sigmoid({x})", _mono(_sig)),
    "silu": Unary("F.silu({x})", _silu_rng),
    "gelu": Unary("F.gelu({x})", _gelu_rng),
    "gelu_tanh": Unary("F.gelu({x}, approximate='tanh')", _gelu_rng),
    "relu": Unary("torch.relu({x})", lambda lo, hi: (max(lo, 0.0), max(hi, 0.0))),
    "leaky_relu": Unary(
        "F.leaky_relu({x}, 0.1)", lambda lo, hi: (min(lo, 0.1 * lo), max(hi, 0.1 * hi))
    ),
    "elu": Unary("F.elu({x})", lambda lo, hi: (max(lo, -1.0), max(hi, -1.0 + 1e-9))),
    "softplus": Unary(
        "F.softplus({x})",
        _mono(lambda v: math.log1p(math.exp(v)) if v < 30 else v),
        lambda lo, hi: hi <= 30,
    ),
    "hardtanh": Unary(
        "F.hardtanh({x})", lambda lo, hi: (min(max(lo, -1.0), 1.0), max(min(hi, 1.0), -1.0))
    ),
    "rsqrt": Unary(
        "torch.rsqrt({x})",
        lambda lo, hi: (1 / math.sqrt(hi), 1 / math.sqrt(lo)),
        lambda lo, hi: lo >= 0.25,
    ),
    "sqrt": Unary("torch.sqrt({x})", _mono(math.sqrt), lambda lo, hi: lo >= 0.25),
    "log": Unary("torch.log({x})", _mono(math.log), lambda lo, hi: lo >= 0.25),
    "log1p": Unary("torch.log1p({x})", _mono(math.log1p), lambda lo, hi: lo >= -0.5),
    "expm1": Unary("torch.expm1({x})", _mono(math.expm1), lambda lo, hi: hi <= 5),
    "reciprocal": Unary("torch.reciprocal({x})", lambda lo, hi: (1 / hi, 1 / lo), _away(0.5)),
    "square": Unary("{x} * {x}", _sq, lambda lo, hi: max(abs(lo), abs(hi)) <= 30),
    "pow3": Unary(
        "torch.pow({x}, 3)", _mono(lambda v: v**3), lambda lo, hi: max(abs(lo), abs(hi)) <= 8
    ),
    "sin": Unary(
        "torch.sin({x})", lambda lo, hi: (-1.0, 1.0), lambda lo, hi: max(abs(lo), abs(hi)) <= 8
    ),
    "cos": Unary(
        "torch.cos({x})", lambda lo, hi: (-1.0, 1.0), lambda lo, hi: max(abs(lo), abs(hi)) <= 8
    ),
    "erf": Unary("torch.erf({x})", _mono(math.erf)),
    "clamp": Unary(
        "torch.clamp({x}, -1.5, 1.25)",
        lambda lo, hi: (min(max(lo, -1.5), 1.25), max(min(hi, 1.25), -1.5)),
    ),
    "scale": Unary("{x} * 0.375", lambda lo, hi: (0.375 * lo, 0.375 * hi)),
    "shift": Unary("{x} + 1.5", lambda lo, hi: (lo + 1.5, hi + 1.5)),
    "rsub": Unary("1.0 - {x}", lambda lo, hi: (1 - hi, 1 - lo)),
    "div_const": Unary("{x} / 3.0", lambda lo, hi: (lo / 3, hi / 3)),
}


def _sample_unary(b):
    name = b.rng.choice(list(UNARY))
    u = UNARY[name]
    x = b.pick_float(lambda n: u.ok(n.lo, n.hi))
    if x is None:
        return None
    return "unary", (x,), {"f": name}


def _code_unary(g, n, a):
    return UNARY[n.attrs["f"]].template.format(x=a[0])


@op("unary", 14, _sample_unary, _code_unary)
def _infer_unary(g, n):
    x = _same_float(g, n)
    u = UNARY.get(n.attrs["f"])
    if u is None or not u.ok(x.lo, x.hi):
        raise Invalid(f"{n.attrs['f']} of [{x.lo}, {x.hi}]")
    n.shape, n.dtype = x.shape, x.dtype
    lo, hi = u.rng(x.lo, x.hi)
    n.lo, n.hi = min(lo, hi), max(lo, hi)


# ---- element-wise: binary, with broadcasting ---------------------------------------------

BINARY = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / {b}",
    "maximum": "torch.maximum({a}, {b})",
    "minimum": "torch.minimum({a}, {b})",
}


def _binary_range(f: str, a: Node, b: Node) -> tuple[float, float]:
    if f == "add":
        return a.lo + b.lo, a.hi + b.hi
    if f == "sub":
        return a.lo - b.hi, a.hi - b.lo
    if f == "mul":
        return _interval_mul(a, b)
    if f == "div":
        if not (b.lo >= 0.5 or b.hi <= -0.5):
            raise Invalid("divisor near 0")
        return _interval_mul(a, (1 / b.hi, 1 / b.lo))
    if f == "maximum":
        return max(a.lo, b.lo), max(a.hi, b.hi)
    return min(a.lo, b.lo), min(a.hi, b.hi)


def _sample_binary(b):
    f = b.rng.choice(list(BINARY))
    x = b.pick_float()
    if x is None:
        return None
    xn = b.g.nodes[x]
    if f == "div":
        y = b.pick_float(lambda n: n.lo >= 0.5 and _broadcastable(n.shape, xn.shape))
        if y is None or b.rng.random() < 0.5:
            y = b.new_float(b.broadcast_of(x), 0.5, 2.0, dtype=xn.dtype)
    else:
        y = b.pick_float(lambda n: _broadcastable(n.shape, xn.shape), exclude=x)
        if y is None or b.rng.random() < 0.4:
            y = b.new_float(b.broadcast_of(x), dtype=xn.dtype)
    if b.rng.random() < 0.5 and f != "div":
        x, y = y, x
    return "binary", (x, y), {"f": f}


def _broadcastable(a, b) -> bool:
    try:
        _broadcast(a, b)
        return True
    except Invalid:
        return False


@op("binary", 14, _sample_binary, lambda g, n, a: BINARY[n.attrs["f"]].format(a=a[0], b=a[1]))
def _infer_binary(g, n):
    a, b = _same_float(g, n, 0), _same_float(g, n, 1)
    n.shape = _broadcast(a.shape, b.shape)
    n.dtype = _promote(a, b)
    n.lo, n.hi = _binary_range(n.attrs["f"], a, b)


# ---- masks: where, masked_fill --------------------------------------------------------
# A mask is a boolean input, a comparison of a float *input* with a constant
# (exact on every device), or a causal mask made from aranges.


def _sample_where(b):
    x = b.pick_float()
    if x is None:
        return None
    xn = b.g.nodes[x]
    kind = b.rng.choice(["input", "compare", "causal"])
    if kind == "causal" and len(xn.shape) >= 2:
        m = ("causal", len(xn.shape))
        mask = None
    else:
        kind = "input" if kind == "causal" else kind
        m = None
        if kind == "compare":
            src = b.pick(
                lambda n: (
                    n.op == "input"
                    and n.attrs["kind"] == "float"
                    and _broadcastable(n.shape, xn.shape)
                    and len(n.shape) <= len(xn.shape)
                )
            )
            if src is None:
                src = b.new_float(b.broadcast_of(x))
            mask = src
        else:
            mask = b.new_mask(b.broadcast_of(x))
    fill = b.rng.random() < 0.4
    if fill:
        args = (x,) if mask is None else (mask, x)
        return "where", args, {"mask": kind if m is None else "causal", "fill": -0.75}
    y = b.pick_float(lambda n: _broadcastable(n.shape, xn.shape), exclude=x)
    if y is None:
        y = b.new_float(b.broadcast_of(x), dtype=xn.dtype)
    args = (x, y) if mask is None else (mask, x, y)
    return "where", args, {"mask": "causal" if m else kind}


def _mask_code(g, n, a) -> tuple[str, list[str]]:
    kind = n.attrs["mask"]
    if kind == "causal":
        x = g.nodes[n.args[0]]
        r, c = x.shape[-2], x.shape[-1]
        return (
            f"(torch.arange({r}, device={a[0]}.device)[:, None] >= "
            f"torch.arange({c}, device={a[0]}.device)[None, :])"
        ), a
    if kind == "compare":
        return f"({a[0]} > 0.25)", a[1:]
    return a[0], a[1:]


def _code_where(g, n, a):
    mask, rest = _mask_code(g, n, a)
    if "fill" in n.attrs:
        return f"{rest[0]}.masked_fill({mask}, {n.attrs['fill']!r})"
    return f"torch.where({mask}, {rest[0]}, {rest[1]})"


@op("where", 4, _sample_where, _code_where)
def _infer_where(g, n):
    kind = n.attrs["mask"]
    args = [g.nodes[i] for i in n.args]
    if kind == "causal":
        vals = args
        if len(vals[0].shape) < 2:
            raise Invalid("causal mask of rank < 2")
        mshape = vals[0].shape[-2:]
    else:
        m, vals = args[0], args[1:]
        if kind == "compare":
            if not (m.op == "input" and m.attrs["kind"] == "float"):
                raise Invalid("compare of a computed value")
        elif m.dtype != "bool":
            raise Invalid("mask dtype")
        mshape = m.shape
    for v in vals:
        if not v.is_float:
            raise Invalid("where of non-float")
    shape = vals[0].shape
    for v in vals[1:]:
        shape = _broadcast(shape, v.shape)
    n.shape = _broadcast(shape, mshape)
    if "fill" in n.attrs:
        if n.shape != vals[0].shape:
            raise Invalid("masked_fill broadcasts its input")
        f = n.attrs["fill"]
        n.dtype, n.lo, n.hi = vals[0].dtype, min(vals[0].lo, f), max(vals[0].hi, f)
    else:
        n.dtype = _promote(*vals)
        n.lo, n.hi = min(v.lo for v in vals), max(v.hi for v in vals)
