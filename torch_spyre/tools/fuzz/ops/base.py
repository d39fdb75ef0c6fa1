"""The grammar's shared part: the ``Op`` record, the ``OPS`` registry and the
typing helpers every op uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_spyre.tools.fuzz.graph import Graph, Invalid, Node

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
