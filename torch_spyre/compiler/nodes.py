"""Inductor's scheduler nodes as the program builder sees them.

Static sizes (a symbolic size is specialised with a guard), index
simplification, the variables a node's indexes divide (split in two so every
index stays affine), buffer layouts, and running a node's store function
into a ``lowering.ProgramBuilder``.  Used by the scheduling (fused groups)
and by the extern matmuls (``compiler/matmuls.py``).
"""

from __future__ import annotations

import logging
import math

import sympy
import torch
from torch._inductor import ir
from torch._inductor.scheduler import BaseSchedulerNode
from torch._inductor.virtualized import V
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from torch_spyre.compiler import lowering
from torch_spyre.compiler.views import dim_pieces

log = logging.getLogger("torch_spyre.compiler")

_warned_dynamic: set[tuple[int, str]] = set()


def _static(values, what: str) -> list[int]:
    """Sizes as ints.  A symbolic size (automatic dynamic shapes) is specialised
    to its current value with a guard, so Dynamo recompiles for another size:
    kernel programs are planned for static shapes."""
    out = []
    for v in values:
        if isinstance(v, torch.SymInt):  # an FX value's size: its expression
            v = v.node.expr
        if isinstance(v, int) or getattr(v, "is_Integer", False):
            out.append(int(v))
            continue
        n = V.graph.sizevars.guard_int(v)
        key = (id(V.graph), str(v))  # one line per size and graph
        if key not in _warned_dynamic:
            _warned_dynamic.add(key)
            log.warning(
                "spyre: specialising dynamic size %s = %d of %s (kernel programs are planned "
                "for static shapes; another size recompiles)",
                v,
                n,
                what,
            )
        out.append(n)
    return out


def _simplify(expr, ranges=None):
    """An index expression with its size symbols specialised (and guarded), and
    divisions of split variables resolved with their ranges."""
    expr = V.graph.sizevars.simplify(expr)
    free = [x for x in getattr(expr, "free_symbols", ()) if x.name.startswith(("s", "u"))]
    if free:
        vals = _static(free, "an index")
        expr = expr.subs(dict(zip(free, vals)))
    if ranges and expr.has(FloorDiv, ModularIndexing):
        vr = {x: ranges[x.name] for x in expr.free_symbols if x.name in ranges}
        expr = V.graph.sizevars.simplify_with_ranges(expr, vr)
    return expr


class _Opaque:
    """A value in the scanning pass (``_find_splits``): nothing is computed."""

    def __getitem__(self, i):
        return self

    def __iter__(self):
        return iter((self, self, self))


class _IndexScan:
    """An ops handler that only records the index expressions a node uses."""

    def __init__(self) -> None:
        self.indexes: list = []
        #: (buffer, index) of every load and store
        self.accesses: list = []

    def load(self, name, index):
        self.indexes.append(index)
        self.accesses.append((name, index))
        return _Opaque()

    def store(self, name, index, value, mode=None):
        self.indexes.append(index)
        self.accesses.append((name, index))

    def store_reduction(self, name, index, value):
        self.indexes.append(index)
        self.accesses.append((name, index))

    def index_expr(self, expr, dtype):
        self.indexes.append(expr)
        return _Opaque()

    def masked(self, mask, body, other):
        return body()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: _Opaque()


def _find_splits(node, pw, red) -> dict[int, int | list[int]]:
    """Iteration variables a node's indexes divide, so that every index stays
    affine and reads each buffer dim with its own variables: position -> ``d``
    (the variable becomes two, ``v = d * hi + lo``) or a list of factor sizes
    (outer to inner, a mixed-radix sum).

    Two kinds: a division in the index (``v // d``, ``v % d``: a reshape or a
    repeat_interleave), and a variable whose range runs across a buffer's dims
    (a flat copy ``buf[x0]`` of a contiguous ``[16, 128]`` buffer, Inductor's
    ``clone_preserve_strides``: ``x0`` becomes ``128 * hi + lo``)."""
    sizes = list(pw) + list(red)
    syms = [sympy.Symbol(f"q{i}", integer=True, nonnegative=True) for i in range(len(sizes))]
    scan = _IndexScan()
    store = node.node.get_store_function()
    try:
        with V.set_ops_handler(scan):
            if red:
                store(syms[: len(pw)], syms[len(pw) :])
            else:
                store(syms)
    except Exception:  # the planning pass reports what it cannot do
        return {}
    found: dict[int, set[int]] = {}
    for e in scan.indexes:
        e = sympy.sympify(e)
        for atom in e.atoms(FloorDiv, ModularIndexing):
            base, div = atom.args[0], atom.args[1]
            if base not in syms or not div.is_Integer:
                continue
            i = syms.index(base)
            d = int(div)
            if isinstance(atom, ModularIndexing) and d == 1:
                d = int(atom.args[2])
            if 1 < d < sizes[i] and sizes[i] % d == 0:
                found.setdefault(i, set()).add(d)
    for name, e in scan.accesses:
        for i, d in _crossings(name, e, syms, sizes):
            found.setdefault(i, set()).add(d)
    out: dict[int, int | list[int]] = {}
    for i, ds in found.items():
        chain = sorted(ds)
        if any(b % a for a, b in zip(chain, chain[1:])):
            continue  # splits that do not nest: left as they are (the planner says why)
        if len(chain) == 1:
            out[i] = chain[0]
        else:
            # factor sizes, outer to inner: the product is the whole range (the
            # innermost piece, chain[0], was left out: a range of 8 read as
            # [2, 2, 2] iterated 4 of its values; fuzzer seed 904073)
            steps = [b // a for a, b in zip(chain, chain[1:])][::-1]
            out[i] = [sizes[i] // chain[-1], *steps, chain[0]]
    return out


def _crossings(name: str, index, syms, sizes) -> list[tuple[int, int]]:
    """(variable position, inner range) for each split a variable of an affine
    ``index`` of buffer ``name`` needs to read the buffer one dim per piece
    (``views.dim_pieces``)."""
    try:
        bsize, bstride, _, _ = _buffer_info(_storage_name(name))
    except Exception:  # not a buffer with a fixed layout: nothing to say
        return []
    e = sympy.expand(sympy.sympify(index))
    out = []
    for i, s in enumerate(syms):
        c = e.coeff(s)
        if not c.is_Integer or int(c) <= 0:
            continue
        pieces = dim_pieces(int(c), sizes[i], bsize, bstride)
        for k in range(1, len(pieces or ())):
            out.append((i, math.prod(pieces[k:])))
    return out


def _node_vars(b: lowering.ProgramBuilder, prefix: str, sizes, splits, first: int) -> list:
    """One expression per iteration dim: a variable, or ``hi * d + lo`` for a
    split ``d``, or a mixed-radix sum for a list of factor sizes (outer to inner)."""
    out = []
    for i, size in enumerate(sizes):
        d = splits.get(first + i)
        if d is None:
            out.extend(b.new_vars(prefix, [size]))
        elif isinstance(d, list):
            expr, acc = sympy.Integer(0), 1
            for v, f in reversed(list(zip(b.new_vars(prefix, d), d))):
                expr, acc = expr + v * acc, acc * f
            out.append(expr)
        else:
            hi, lo = b.new_vars(prefix, [size // d, d])
            out.append(hi * d + lo)
    return out


def _storage_name(name: str) -> str:
    """The buffer whose memory ``name`` writes: an in-place update of a graph
    input (a KV cache's copy_) is a node with a mutation layout over it."""
    try:
        buf = V.graph.get_buffer(name)
    except Exception:  # an expression such as "mm_out[0]", not a buffer name
        return name
    layout = getattr(buf, "layout", None)
    if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
        return layout.get_buffer().get_name()
    return name


def _buffer_info(name: str):
    buf = V.graph.get_buffer(name)
    if buf is None:
        raise KeyError(name)
    lay = buf.get_layout()
    size = tuple(_static(lay.size, name))
    stride = tuple(_static(lay.stride, name))
    offset = _static([lay.offset], name)[0]
    return size, stride, offset, lay.dtype


def _sizes(node: BaseSchedulerNode):
    data = node.node.data
    pw = _static(data.get_pointwise_size(), node.get_name())
    red = (
        _static(data.get_reduction_size(), node.get_name())
        if isinstance(data, ir.Reduction)
        else []
    )
    return pw, red


def run_nodes(b: lowering.ProgramBuilder, nodes, factors: dict | None = None) -> None:
    """Record the steps of each scheduler node's store function in ``b``.

    ``factors``: {(pointwise sizes, dim): factor sizes} to iterate a dim of the
    nodes of those sizes as several variables (a matmul's weight prologue is
    iterated as the matmul reads the weight)."""
    for n in nodes:
        pw, red = _sizes(n)
        splits = _find_splits(n, pw, red)
        for (sizes, dim), fs in (factors or {}).items():
            if tuple(pw) == sizes and len(fs) > 1 and dim not in splits:
                splits[dim] = list(fs)
        vars_ = _node_vars(b, "x", pw, splits, 0)
        rvars = _node_vars(b, "r", red, splits, len(pw))
        b.node_rvars = sorted({x.name for v in rvars for x in sympy.sympify(v).free_symbols})
        b.node_vars = [x.name for v in (*vars_, *rvars) for x in sympy.sympify(v).free_symbols]
        b.node_origins = tuple(getattr(n.node, "origins", None) or ())
        store = n.node.get_store_function()
        with V.set_ops_handler(b):
            if red:
                store(vars_, rvars)
            else:
                store(vars_)
