"""The fuzzer's grammar: the ops models use, each with its typing rule.

Every op has

* ``sample(b)``: pick operands among the graph's nodes (or new inputs tied to
  their shapes) and attributes, or ``None`` when nothing fits;
* ``infer(g, n)``: the result's shape, dtype, value range and accumulation
  length, raising ``Invalid`` when the operands do not fit (the minimiser
  relies on this after it shrinks shapes);
* ``code(g, n, args)``: the Python expression (plain ``torch``).

Value ranges (interval arithmetic) keep every value finite and away from the
ill-conditioned spots of the grammar: ``exp`` only of values at most 5, a
divisor, ``log``, ``sqrt`` and ``rsqrt`` only of operands bounded away from 0,
comparisons only of graph inputs (a comparison of computed values flips with
the last bit), casts to 16 bits rounded like any op (their rounding is part
of the reference's noise model, ``oracle.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch_spyre.tools.fuzz.graph import FLOAT_DTYPES, Graph, Invalid, Node

#: |values| beyond this are not produced (ranges are conservative)
MAX_BOUND = 1e3


def _dt(n: Node) -> str:
    return f"torch.{n.dtype}"


def _norm_dim(d: int, rank: int) -> int:
    if not -rank <= d < rank:
        raise Invalid(f"dim {d} of rank {rank}")
    return d % rank


def _same_float(g: Graph, n: Node, k: int = 0) -> Node:
    x = g.nodes[n.args[k]]
    if not x.is_float:
        raise Invalid(f"{n.op} of {x.dtype}")
    return x


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            raise Invalid(f"broadcast {a} {b}")
        out.append(max(x, y))
    return tuple(reversed(out))


def _promote(*nodes: Node) -> str:
    floats = [n.dtype for n in nodes if n.is_float]
    if not floats:
        return "float32"
    return "float32" if "float32" in floats else floats[0]


def _interval_mul(a: Node | tuple, b: Node | tuple) -> tuple[float, float]:
    al, ah = (a.lo, a.hi) if isinstance(a, Node) else a
    bl, bh = (b.lo, b.hi) if isinstance(b, Node) else b
    p = [al * bl, al * bh, ah * bl, ah * bh]
    return min(p), max(p)


def _check_bound(n: Node) -> None:
    if n.is_float and max(abs(n.lo), abs(n.hi)) > MAX_BOUND:
        raise Invalid(f"{n.op}: range [{n.lo}, {n.hi}] too wide")
    if n.dtype == "float16" and max(abs(n.lo), abs(n.hi)) > 6e4:
        raise Invalid("float16 range")


@dataclass
class Op:
    """An op of the grammar: ``weight`` is how often the generator tries it."""

    name: str
    weight: float
    sample: Callable
    infer_fn: Callable
    code: Callable

    def infer(self, g: Graph, n: Node) -> None:
        n.acc = 1
        self.infer_fn(g, n)
        _check_bound(n)


OPS: dict[str, Op] = {}


def op(name: str, weight: float, sample: Callable, code: Callable):
    """Register the decorated infer function as op ``name``."""

    def deco(infer_fn):
        OPS[name] = Op(name, weight, sample, infer_fn, code)
        return infer_fn

    return deco


# ---- element-wise: unary ---------------------------------------------------------------


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


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


# ---- reductions ----------------------------------------------------------------------------

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


# ---- views and data movement --------------------------------------------------------------


def _sample_view(b):
    x = b.pick()
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    rank = len(shape)
    kinds = ["unsqueeze", "permute", "transpose", "contiguous", "flip"]
    if rank >= 2:
        kinds += ["merge", "merge", "flatten", "movedim", "mT"]
    if any(s > 1 and _divisors(s) for s in shape):
        kinds += ["split", "split"]
    if 1 in shape:
        kinds += ["squeeze", "expand"]
    kind = b.rng.choice(kinds)
    a: dict = {"kind": kind}
    if kind == "unsqueeze":
        a["dim"] = b.rng.randint(0, rank)
    elif kind == "permute":
        p = list(range(rank))
        b.rng.shuffle(p)
        a["perm"] = p
    elif kind in ("transpose", "movedim"):
        if rank < 2:
            return None
        a["dims"] = b.rng.sample(range(rank), 2)
    elif kind == "flip":
        a["dims"] = [b.rng.randrange(rank)]
    elif kind == "merge":
        a["dim"] = b.rng.randrange(rank - 1)
    elif kind == "flatten":
        s = b.rng.randrange(rank - 1)
        a["dims"] = [s, b.rng.randint(s + 1, rank - 1)]
    elif kind == "split":
        d = b.rng.choice([i for i, s in enumerate(shape) if s > 1 and _divisors(s)])
        a["dim"], a["factor"] = d, b.rng.choice(_divisors(shape[d]))
    elif kind == "squeeze":
        a["dim"] = b.rng.choice([i for i, s in enumerate(shape) if s == 1])
    elif kind == "expand":
        a["dim"] = b.rng.choice([i for i, s in enumerate(shape) if s == 1])
        a["size"] = b.size()
    return "view", (x,), a


def _divisors(s: int) -> list[int]:
    return [f for f in range(2, s) if s % f == 0][:6]


def _code_view(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    if k == "unsqueeze":
        return f"{a[0]}.unsqueeze({at['dim']})"
    if k == "squeeze":
        return f"{a[0]}.squeeze({at['dim']})"
    if k == "permute":
        return f"{a[0]}.permute({', '.join(map(str, at['perm']))})"
    if k == "transpose":
        return f"{a[0]}.transpose({at['dims'][0]}, {at['dims'][1]})"
    if k == "movedim":
        return f"{a[0]}.movedim({at['dims'][0]}, {at['dims'][1]})"
    if k == "mT":
        return f"{a[0]}.mT"
    if k == "contiguous":
        return f"{a[0]}.contiguous()"
    if k == "flip":
        return f"{a[0]}.flip({at['dims']})"
    if k == "flatten":
        return f"{a[0]}.flatten({at['dims'][0]}, {at['dims'][1]})"
    if k == "expand":
        return f"{a[0]}.expand({', '.join(map(str, n.shape))})"
    return f"{a[0]}.reshape({', '.join(map(str, n.shape))})"


@op("view", 10, _sample_view, _code_view)
def _infer_view(g, n):
    x = g.nodes[n.args[0]]
    s = list(x.shape)
    rank = len(s)
    at, k = n.attrs, n.attrs["kind"]
    if k == "unsqueeze":
        if not 0 <= at["dim"] <= rank:
            raise Invalid("unsqueeze dim")
        s.insert(at["dim"], 1)
    elif k == "squeeze":
        d = _norm_dim(at["dim"], rank)
        if s[d] != 1:
            raise Invalid("squeeze of a dim > 1")
        s.pop(d)
    elif k == "permute":
        if sorted(at["perm"]) != list(range(rank)):
            raise Invalid("permutation")
        s = [s[i] for i in at["perm"]]
    elif k in ("transpose", "movedim"):
        i, j = (_norm_dim(d, rank) for d in at["dims"])
        if k == "transpose":
            s[i], s[j] = s[j], s[i]
        else:
            s.insert(j, s.pop(i))
    elif k == "mT":
        if rank < 2:
            raise Invalid("mT of rank < 2")
        s[-1], s[-2] = s[-2], s[-1]
    elif k == "flip":
        for d in at["dims"]:
            _norm_dim(d, rank)
    elif k == "merge":
        d = at["dim"]
        if not 0 <= d < rank - 1:
            raise Invalid("merge dim")
        s[d : d + 2] = [s[d] * s[d + 1]]
    elif k == "flatten":
        a0, a1 = at["dims"]
        if not 0 <= a0 < a1 < rank:
            raise Invalid("flatten dims")
        s[a0 : a1 + 1] = [math.prod(s[a0 : a1 + 1])]
    elif k == "split":
        d, f = _norm_dim(at["dim"], rank), at["factor"]
        if s[d] % f:
            raise Invalid("split of an indivisible dim")
        s[d : d + 1] = [f, s[d] // f]
    elif k == "expand":
        d = _norm_dim(at["dim"], rank)
        if s[d] != 1:
            raise Invalid("expand of a dim > 1")
        s[d] = at["size"]
    elif k != "contiguous":
        raise Invalid(k)
    if len(s) > 5 or len(s) < 1:
        raise Invalid("rank")
    n.shape, n.dtype, n.lo, n.hi = tuple(s), x.dtype, x.lo, x.hi


def _sample_slice(b):
    x = b.pick(lambda n: max(n.shape) > 1)
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    d = b.rng.choice([i for i, s in enumerate(shape) if s > 1])
    size = shape[d]
    kind = b.rng.choice(["slice", "slice", "select", "chunk", "narrow_end"])
    if kind == "select":
        return "slice", (x,), {"kind": kind, "dim": d, "index": b.rng.randrange(size)}
    if kind == "chunk":
        c = b.rng.randint(2, min(size, 4))
        return "slice", (x,), {"kind": kind, "dim": d, "chunks": c, "index": b.rng.randrange(c)}
    start = b.rng.randrange(size)
    stop = b.rng.randint(start + 1, size)
    step = b.rng.choice([1, 1, 1, 2, 3])
    if kind == "narrow_end":  # x[..., :-k] / x[..., k:]
        return "slice", (x,), {"kind": "slice", "dim": d, "start": start, "stop": None, "step": 1}
    return "slice", (x,), {"kind": kind, "dim": d, "start": start, "stop": stop, "step": step}


def _code_slice(g, n, a):
    at = n.attrs
    pre = ":, " * at["dim"]
    if at["kind"] == "select":
        return f"{a[0]}[{pre}{at['index']}]"
    if at["kind"] == "chunk":
        return f"{a[0]}.chunk({at['chunks']}, {at['dim']})[{at['index']}]"
    stop = "" if at["stop"] is None else at["stop"]
    step = "" if at["step"] == 1 else f":{at['step']}"
    return f"{a[0]}[{pre}{at['start']}:{stop}{step}]"


@op("slice", 6, _sample_slice, _code_slice)
def _infer_slice(g, n):
    x = g.nodes[n.args[0]]
    at = n.attrs
    s = list(x.shape)
    d = at["dim"]
    if not 0 <= d < len(s):
        raise Invalid("slice dim")
    if at["kind"] == "select":
        if not 0 <= at["index"] < s[d]:
            raise Invalid("select index")
        s.pop(d)
        if not s:
            raise Invalid("select to a scalar")
    elif at["kind"] == "chunk":
        c = at["chunks"]
        per = -(-s[d] // c)
        lens = [min(per, s[d] - per * i) for i in range(c)]
        if at["index"] >= len(lens) or lens[at["index"]] < 1:
            raise Invalid("chunk index")
        s[d] = lens[at["index"]]
    else:
        stop = s[d] if at["stop"] is None else at["stop"]
        if not 0 <= at["start"] < stop <= s[d]:
            raise Invalid("slice bounds")
        s[d] = len(range(at["start"], stop, at["step"]))
    n.shape, n.dtype, n.lo, n.hi = tuple(s), x.dtype, x.lo, x.hi


def _sample_cat(b):
    x = b.pick()
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    d = b.rng.randrange(rank)
    stack = b.rng.random() < 0.2
    k = b.rng.choice([2, 2, 3])
    args = [x]
    for _ in range(k - 1):

        def fits(n, xn=xn, d=d, stack=stack):
            if n.dtype != xn.dtype or len(n.shape) != len(xn.shape):
                return False
            return all(a == c for i, (a, c) in enumerate(zip(n.shape, xn.shape)) if stack or i != d)

        y = b.pick(fits, exclude=x)
        if y is None or b.rng.random() < 0.5:
            if not xn.is_float:
                return None
            shape = [[x, i] for i in range(rank)]
            if not stack:
                shape[d] = b.size()
            y = b.new_float(shape, dtype=xn.dtype)
        args.append(y)
    b.rng.shuffle(args)
    if stack:
        d = b.rng.randint(0, rank)
    return "cat", tuple(args), {"dim": d, "stack": stack}


def _code_cat(g, n, a):
    f = "stack" if n.attrs["stack"] else "cat"
    return f"torch.{f}([{', '.join(a)}], dim={n.attrs['dim']})"


@op("cat", 5, _sample_cat, _code_cat)
def _infer_cat(g, n):
    xs = [g.nodes[i] for i in n.args]
    x0 = xs[0]
    d = n.attrs["dim"]
    rank = len(x0.shape)
    for x in xs[1:]:
        if x.dtype != x0.dtype or len(x.shape) != rank:
            raise Invalid("cat operands")
    if n.attrs["stack"]:
        if not 0 <= d <= rank or any(x.shape != x0.shape for x in xs):
            raise Invalid("stack")
        s = list(x0.shape)
        s.insert(d, len(xs))
    else:
        if not 0 <= d < rank:
            raise Invalid("cat dim")
        for x in xs[1:]:
            if any(a != c for i, (a, c) in enumerate(zip(x.shape, x0.shape)) if i != d):
                raise Invalid("cat shapes")
        s = list(x0.shape)
        s[d] = sum(x.shape[d] for x in xs)
    n.shape, n.dtype = tuple(s), x0.dtype
    n.lo, n.hi = min(x.lo for x in xs), max(x.hi for x in xs)


def _sample_rotate(b):
    x = b.pick_float(lambda n: n.shape[-1] % 2 == 0)
    if x is None:
        return None
    return "rotate_half", (x,), {}


@op(
    "rotate_half",
    1.5,
    _sample_rotate,
    lambda g, n, a: (
        f"torch.cat((-{a[0]}[..., {g.nodes[n.args[0]].shape[-1] // 2}:], "
        f"{a[0]}[..., :{g.nodes[n.args[0]].shape[-1] // 2}]), dim=-1)"
    ),
)
def _infer_rotate(g, n):
    x = _same_float(g, n)
    if x.shape[-1] % 2:
        raise Invalid("rotate_half of an odd dim")
    n.shape, n.dtype = x.shape, x.dtype
    n.lo, n.hi = -x.bound, x.bound


def _sample_pad(b):
    x = b.pick_float()
    if x is None:
        return None
    rank = len(b.g.nodes[x].shape)
    mode = b.rng.choice(["constant", "constant", "constant", "reflect", "replicate"])
    k = 1 if rank < 3 or b.rng.random() < 0.6 else 2
    if mode != "constant" and rank < 2:
        mode = "constant"
    pads = [b.rng.randint(0, 3) for _ in range(2 * k)]
    if not any(pads):
        pads[0] = 1
    return "pad", (x,), {"mode": mode, "pads": pads, "value": b.rng.choice([0.0, 0.5])}


def _code_pad(g, n, a):
    at = n.attrs
    if at["mode"] == "constant":
        return f"F.pad({a[0]}, {at['pads']}, value={at['value']!r})"
    return f"F.pad({a[0]}, {at['pads']}, mode={at['mode']!r})"


@op("pad", 3, _sample_pad, _code_pad)
def _infer_pad(g, n):
    x = _same_float(g, n)
    at = n.attrs
    pads = at["pads"]
    k = len(pads) // 2
    s = list(x.shape)
    if k > len(s) or any(p < 0 for p in pads):
        raise Invalid("pad")
    for i in range(k):
        d = len(s) - 1 - i
        if at["mode"] == "reflect" and max(pads[2 * i], pads[2 * i + 1]) >= s[d]:
            raise Invalid("reflect pad wider than the dim")
        s[d] += pads[2 * i] + pads[2 * i + 1]
    if at["mode"] != "constant" and not (len(s) - k in (1, 2) and len(s) >= 2):
        raise Invalid("non-constant pad rank")
    n.shape, n.dtype = tuple(s), x.dtype
    v = at["value"] if at["mode"] == "constant" else x.lo
    n.lo, n.hi = min(x.lo, v), max(x.hi, v)


def _sample_misc(b):
    x = b.pick()
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    rank = len(shape)
    kind = b.rng.choice(["roll", "repeat", "repeat_interleave", "tril", "triu", "cumsum", "cumsum"])
    if kind in ("tril", "triu") and rank < 2:
        kind = "roll"
    if kind == "cumsum" and not b.g.nodes[x].is_float:
        kind = "roll"
    a = {"kind": kind, "dim": b.rng.randrange(rank)}
    if kind == "roll":
        a["shift"] = b.rng.choice([1, -1, 2, 5])
    elif kind == "repeat":
        a["reps"] = [b.rng.choice([1, 1, 2, 3]) for _ in range(rank)]
    elif kind == "repeat_interleave":
        a["reps"] = b.rng.choice([2, 3])
    elif kind in ("tril", "triu"):
        a["diag"] = b.rng.choice([0, 0, 1, -1])
    return "misc", (x,), a


def _code_misc(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    if k == "roll":
        return f"torch.roll({a[0]}, {at['shift']}, {at['dim']})"
    if k == "repeat":
        return f"{a[0]}.repeat({', '.join(map(str, at['reps']))})"
    if k == "repeat_interleave":
        return f"{a[0]}.repeat_interleave({at['reps']}, dim={at['dim']})"
    if k in ("tril", "triu"):
        return f"torch.{k}({a[0]}, {at['diag']})"
    return f"torch.cumsum({a[0]}, dim={at['dim']})"


@op("misc", 4, _sample_misc, _code_misc)
def _infer_misc(g, n):
    x = g.nodes[n.args[0]]
    at, k = n.attrs, n.attrs["kind"]
    s = list(x.shape)
    d = at["dim"]
    if not 0 <= d < len(s):
        raise Invalid("dim")
    n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi
    if k == "repeat":
        if len(at["reps"]) != len(s):
            raise Invalid("repeat rank")
        s = [a * r for a, r in zip(s, at["reps"])]
    elif k == "repeat_interleave":
        s[d] *= at["reps"]
    elif k in ("tril", "triu"):
        if len(s) < 2:
            raise Invalid("tril of rank < 2")
        n.lo, n.hi = min(x.lo, 0.0), max(x.hi, 0.0)
    elif k == "cumsum":
        if not x.is_float:
            raise Invalid("cumsum of non-float")
        n.acc = s[d]
        n.lo, n.hi = min(x.lo * s[d], x.lo), max(x.hi * s[d], x.hi)
    n.shape = tuple(s)


# ---- gathers and scatters ----------------------------------------------------------------


def _sample_index(b):
    x = b.pick_float()
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    d = b.rng.randrange(rank)
    kind = b.rng.choice(
        ["gather", "index_select", "index", "embedding", "scatter_add", "scatter", "index_add"]
    )
    if kind == "embedding":
        if rank != 2:
            kind = "index_select"
        else:
            d = 0
    if kind == "index" and b.rng.random() < 0.5:
        d = 0
    if kind in ("gather", "scatter_add", "scatter"):
        # index of x's rank, within x's shape off `d`
        shape = [[x, i] if i != d else b.rng.randint(1, max(1, xn.shape[d])) for i in range(rank)]
        if kind == "gather":
            shape[d] = b.size()
        unique = d if kind == "scatter" else None
        idx = b.new_index(shape, [x, d], unique=unique)
        if kind == "gather":
            return "index", (x, idx), {"kind": kind, "dim": d}
        src = b.new_float([[idx, i] for i in range(rank)], dtype=xn.dtype)
        return "index", (x, idx, src), {"kind": kind, "dim": d}
    if kind == "index_add":
        k = b.rng.randint(1, 8)
        idx = b.new_index([k], [x, d])
        src = b.new_float([[x, i] if i != d else [idx, 0] for i in range(rank)], dtype=xn.dtype)
        return "index", (x, idx, src), {"kind": kind, "dim": d}
    ishape = [b.rng.randint(1, 9)]
    if kind in ("index", "embedding") and b.rng.random() < 0.3:
        ishape.append(b.rng.randint(1, 5))
    idx = b.new_index(ishape, [x, d])
    if kind == "embedding":
        return "index", (idx, x), {"kind": kind, "dim": 0}
    return "index", (x, idx), {"kind": kind, "dim": d}


def _code_index(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    d = at["dim"]
    if k == "gather":
        return f"torch.gather({a[0]}, {d}, {a[1]})"
    if k == "index_select":
        return f"torch.index_select({a[0]}, {d}, {a[1]})"
    if k == "index":
        return f"{a[0]}[{':, ' * d}{a[1]}]"
    if k == "embedding":
        return f"F.embedding({a[0]}, {a[1]})"
    if k == "scatter_add":
        return f"{a[0]}.scatter_add({d}, {a[1]}, {a[2]})"
    if k == "scatter":
        return f"{a[0]}.scatter({d}, {a[1]}, {a[2]})"
    return f"{a[0]}.index_add({d}, {a[1]}, {a[2]})"


@op("index", 5, _sample_index, _code_index)
def _infer_index(g, n):
    at, k = n.attrs, n.attrs["kind"]
    args = [g.nodes[i] for i in n.args]
    d = at["dim"]
    if k == "embedding":
        idx, w = args
        x = w
        if len(w.shape) != 2 or d != 0:
            raise Invalid("embedding weight")
    else:
        x, idx = args[0], args[1]
    if not x.is_float or idx.dtype != "int64":
        raise Invalid("index operand dtypes")
    if not 0 <= d < len(x.shape) or idx.hi >= x.shape[d]:
        raise Invalid("index out of range")
    s = list(x.shape)
    n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi
    if k in ("gather", "scatter_add", "scatter"):
        if len(idx.shape) != len(s):
            raise Invalid("gather index rank")
        if any(a > c for i, (a, c) in enumerate(zip(idx.shape, s)) if i != d or k != "gather"):
            raise Invalid("gather index shape")
        if k == "gather":
            n.shape = idx.shape
            return
        src = args[2]
        if src.shape != idx.shape or src.dtype != x.dtype:
            raise Invalid("scatter source")
        if k == "scatter":
            if idx.attrs.get("unique") != d:
                raise Invalid("scatter needs distinct indices")
            n.lo, n.hi = min(x.lo, src.lo), max(x.hi, src.hi)
        else:
            cnt = idx.shape[d]
            n.acc = cnt + 1
            n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
        n.shape = tuple(s)
        return
    if k == "index_add":
        src = args[2]
        if len(idx.shape) != 1:
            raise Invalid("index_add index rank")
        want = list(s)
        want[d] = idx.shape[0]
        if list(src.shape) != want or src.dtype != x.dtype:
            raise Invalid("index_add source")
        cnt = idx.shape[0]
        n.acc = cnt + 1
        n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
        n.shape = tuple(s)
        return
    if k == "index_select" and len(idx.shape) != 1:
        raise Invalid("index_select index rank")
    if k == "embedding":
        n.shape = (*idx.shape, s[1])
        return
    s[d : d + 1] = list(idx.shape)
    n.shape = tuple(s)


# ---- contractions ------------------------------------------------------------------------


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


# ---- casts ----------------------------------------------------------------------------------


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


__all__ = ["MAX_BOUND", "OPS", "Op"]
