"""The fuzzer's graph: a list of typed nodes, its shape inference and its code.

A graph is a list of ``Node``s in topological order.  A node is an input
(``op == "input"``: a float tensor in a value range, an index tensor or a
boolean mask, possibly a non-contiguous view) or an op of the grammar
(``ops.OPS``) applied to earlier nodes, with attributes.  Shapes, dtypes and
value ranges are *inferred* (``Graph.infer``), never stored by hand: an
input's shape is a list whose entries are sizes or references to a dim of an
earlier node (``[node, dim]``), so when the minimiser shrinks one size, every
shape tied to it follows, and a graph that no longer type-checks is rejected
(``Invalid``) instead of run.

The graph becomes Python source (``Graph.source``): a function of its inputs
written with plain ``torch`` calls, which runs on the CPU, eagerly on spyre,
under ``torch.compile`` and in a regression test unchanged.  The inputs are
made by source too (``Graph.input_source``), seeded, so every device sees the
same values.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

#: the float dtypes the grammar produces, their names in generated code
FLOAT_DTYPES = ("float32", "float16")
#: relative rounding of one op's result per dtype (a full ulp)
ULP = {"float32": 2.0**-23, "float16": 2.0**-10, "float64": 2.0**-52}


class Invalid(Exception):
    """A graph (or a node of it) does not type-check."""


@dataclass
class Node:
    op: str
    args: tuple[int, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    # inferred by Graph.infer
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    lo: float = 0.0
    hi: float = 0.0
    #: terms accumulated into one result element (reductions, contractions)
    acc: int = 1

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bound(self) -> float:
        return max(abs(self.lo), abs(self.hi))


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    #: seed of the input values
    seed: int = 0

    def copy(self) -> Graph:
        return copy.deepcopy(self)

    # ---- building -----------------------------------------------------------------

    def add(self, node: Node) -> int:
        """Append ``node`` (inferring it); its index."""
        self.nodes.append(node)
        try:
            self._infer_node(len(self.nodes) - 1)
        except Invalid:
            self.nodes.pop()
            raise
        return len(self.nodes) - 1

    def inputs(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.op == "input"]

    def users(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {i: [] for i in range(len(self.nodes))}
        for i, n in enumerate(self.nodes):
            for a in n.args:
                out[a].append(i)
            for ref in _refs(n):
                out[ref].append(i)
        return out

    # ---- inference ----------------------------------------------------------------

    def resolve(self, entry) -> int:
        """A shape entry: a size, or ``[node, dim]``: that node's size there."""
        if isinstance(entry, int):
            return entry
        node, dim = entry
        shape = self.nodes[node].shape
        if not -len(shape) <= dim < len(shape):
            raise Invalid(f"dim {dim} of node {node} {shape}")
        return shape[dim]

    def _infer_node(self, i: int) -> None:
        from torch_spyre.tools.fuzz.ops import OPS

        n = self.nodes[i]
        for a in (*n.args, *_refs(n)):
            if not 0 <= a < i:
                raise Invalid(f"node {i} reads node {a}")
        if n.op == "input":
            _infer_input(self, n)
        else:
            OPS[n.op].infer(self, n)
        if not n.shape:
            raise Invalid(f"node {i}: a 0-dim result")
        if any(s < 1 for s in n.shape):
            raise Invalid(f"node {i}: empty shape {n.shape}")
        if n.is_float and not (math.isfinite(n.lo) and math.isfinite(n.hi)):
            raise Invalid(f"node {i}: unbounded range")

    def infer(self) -> None:
        for i in range(len(self.nodes)):
            self._infer_node(i)
        if not self.outputs:
            raise Invalid("no outputs")

    # ---- source -------------------------------------------------------------------

    def source(self, name: str = "fn", hook: bool = False) -> str:
        """``def name(x0, x1, ...): ... return (...)``.  With ``hook``, every
        op runs as ``_h(index, op, *operands)`` (the reference's noise model)."""
        from torch_spyre.tools.fuzz.ops import OPS

        ins = self.inputs()
        lines = [f"def {name}({', '.join(_var(i) for i in ins)}):"]
        for i, n in enumerate(self.nodes):
            if n.op == "input":
                continue
            if hook:
                params = [f"_a{k}" for k in range(len(n.args))]
                expr = OPS[n.op].code(self, n, params)
                args = "".join(f", {_var(a)}" for a in n.args)
                expr = f"_h({i}, lambda {', '.join(params)}: {expr}{args})"
            else:
                expr = OPS[n.op].code(self, n, [_var(a) for a in n.args])
            lines.append(f"    {_var(i)} = {expr}")
        outs = "".join(f"{_var(o)}, " for o in self.outputs)
        lines.append(f"    return ({outs})")
        return "\n".join(lines) + "\n"

    def input_source(self, name: str = "make_inputs") -> str:
        """``def name(device): -> [inputs]``: the graph's inputs, seeded, made
        on the CPU and moved to ``device`` before any view is taken (a
        non-contiguous input is a view on the device too)."""
        lines = [
            f"def {name}(device):",
            f"    g = torch.Generator().manual_seed({self.seed})",
        ]
        for i in self.inputs():
            n = self.nodes[i]
            base, view = _input_code(self, n)
            lines.append(f"    {_var(i)} = {base}.to(device){view}")
        lines.append(f"    return [{', '.join(_var(i) for i in self.inputs())}]")
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        ops = [n.op for n in self.nodes if n.op != "input"]
        return f"{len(ops)} ops ({', '.join(ops)})"


def _var(i: int) -> str:
    return f"v{i}"


def _refs(n: Node) -> list[int]:
    """Nodes an input's shape (or index bound) refers to."""
    if n.op != "input":
        return []
    out = [e[0] for e in n.attrs["shape"] if not isinstance(e, int)]
    high = n.attrs.get("high")
    if high is not None and not isinstance(high, int):
        out.append(high[0])
    return out


# ---- inputs --------------------------------------------------------------------------
#
# attrs: shape (entries: size or [node, dim]); kind: "float" (lo, hi, dtype;
# distinct: every value different, for an input a sort's indices are taken of),
# "index" (high: size or [node, dim]; unique: dim along which values are
# distinct, or None) or "mask" (p: probability of True); layout: "contiguous",
# "transposed" (dims a, b: stored with them swapped), "strided" (dim: every
# other element of a twice as long base), "offset" (dim: a slice starting at 1
# of a longer base) or "expanded" (dim: a size-1 base expanded).


def _infer_input(g: Graph, n: Node) -> None:
    a = n.attrs
    n.shape = tuple(g.resolve(e) for e in a["shape"])
    n.acc = 1
    kind = a["kind"]
    if kind == "float":
        n.dtype = a.get("dtype", "float32")
        n.lo, n.hi = float(a["lo"]), float(a["hi"])
        if not n.lo < n.hi:
            raise Invalid("empty range")
    elif kind == "index":
        n.dtype = "int64"
        high = g.resolve(a["high"])
        if high < 1:
            raise Invalid("index bound")
        unique = a.get("unique")
        if unique is not None and n.shape[unique] > high:
            raise Invalid("unique index longer than its range")
        if a.get("run") and len(n.shape) != 1:
            raise Invalid("a run of positions is one-dimensional")
        n.lo, n.hi = 0.0, float(high - 1)
    elif kind == "mask":
        n.dtype = "bool"
        n.lo, n.hi = 0.0, 1.0
    else:
        raise Invalid(kind)
    layout = a.get("layout", "contiguous")
    if layout in ("transposed",):
        d0, d1 = a["dims"]
        if len(n.shape) < 2 or not (0 <= d0 < d1 < len(n.shape)):
            raise Invalid("layout dims")
    elif layout in ("strided", "offset", "expanded"):
        if not 0 <= a["dim"] < len(n.shape):
            raise Invalid("layout dim")


def _input_code(g: Graph, n: Node) -> tuple[str, str]:
    a = n.attrs
    shape = list(n.shape)
    layout = a.get("layout", "contiguous")
    base_shape = list(shape)
    view = ""
    if layout == "transposed":
        d0, d1 = a["dims"]
        base_shape[d0], base_shape[d1] = base_shape[d1], base_shape[d0]
        view = f".transpose({d0}, {d1})"
    elif layout == "strided":
        d = a["dim"]
        base_shape[d] = 2 * shape[d]
        view = f"[{':, ' * d}::2]"
    elif layout == "offset":
        d = a["dim"]
        base_shape[d] = shape[d] + 3
        view = f"[{':, ' * d}1:{shape[d] + 1}]"
    elif layout == "expanded":
        d = a["dim"]
        base_shape[d] = 1
        view = f".expand({', '.join(map(str, shape))})"
    size = f"({', '.join(map(str, base_shape))},)"
    kind = a["kind"]
    if kind == "float":
        lo, hi = n.lo, n.hi
        dt = "" if n.dtype == "float32" else f".to(torch.{n.dtype})"
        if a.get("distinct"):
            # every value distinct (an index a sort returns must not depend on
            # how a device orders ties; torch.rand's 2**-24 grid ties about
            # once in 10,000 rows of 60, long seed 5000): a random
            # permutation of evenly spaced values, far more than an ulp apart
            count = math.prod(base_shape)
            base = (
                f"(torch.randperm({count}, generator=g).reshape({size}).float()"
                f" * {(hi - lo) / count!r} + {lo!r}){dt}"
            )
        else:
            base = f"(torch.rand({size}, generator=g) * {hi - lo!r} + {lo!r}){dt}"
    elif kind == "index":
        high = int(n.hi) + 1
        unique = a.get("unique")
        if a.get("run"):
            # consecutive positions from a random start (a prefill's cache rows)
            count = base_shape[0]
            base = (
                f"(torch.arange({count}) + torch.randint(0, {high - count + 1}, (1,), generator=g))"
            )
        elif unique is None:
            base = f"torch.randint(0, {high}, {size}, generator=g)"
        else:
            # distinct along `unique`: a prefix of a random permutation there
            full = list(base_shape)
            full[unique] = high
            take = f"[{':, ' * unique}:{base_shape[unique]}]"
            base = (
                f"torch.rand(({', '.join(map(str, full))},), generator=g)"
                f".argsort(dim={unique}){take}"
            )
    else:
        base = f"(torch.rand({size}, generator=g) < {a.get('p', 0.5)!r})"
    return base, view
