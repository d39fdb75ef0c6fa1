"""Inductor loop IR -> one kernel program per fused group of scheduler nodes.

Each scheduler node's store function (``ComputedBuffer.get_store_function``)
is evaluated over its *unsimplified* ranges with an ops handler that records
kernel-program steps instead of printing code:

* every iteration variable becomes a named program dim; ``load``/``store``
  index expressions are decomposed into "host dim k of the buffer is indexed
  by variable v" (``views._decompose``), so operands keep their stick layouts; a
  buffer read in a finer shape than it has (a reshape whose pieces are
  non-stick dims) is presented to the program as a *view layout* of the same
  device bytes, so reshapes never move data;
* across the nodes of a fused group, variables that index the same piece of
  a buffer one node stores and another loads are unified: that buffer stays
  an LX buffer (no store, no reload) unless something outside the group
  reads it;
* pointwise ops become ``Vector`` steps (in fp32 LX buffers: the vector unit
  computes 16-bit data in fp32), reductions ``Reduce`` steps over whole rows
  (a welford / var_mean reduction is two passes over the row in LX);
* LX buffers are reused by liveness (``step_rewrites._reuse_buffers``) and the tile of
  every loop dim is shrunk until the whole working set, double-buffered
  loads/stores included, fits half the LX (``planner._plan_dims``);
* the core split takes the non-reduced dims with the most parallel work,
  the stick dim of stored operands only in whole sticks.

Anything the handler cannot express raises ``Unsupported`` naming the op;
the scheduling then plans the nodes one by one, and a node that still fails
stops compilation with that message (there is no silent host fallback
inside a compiled region).

This module holds the builder (``ProgramBuilder``, the ops handler); the
pieces it uses live beside it: ``compiler.kernel_plan`` (``Plan``,
``OperandUse``, ``Unsupported``), ``compiler.vector_ops`` (the vector ops
added to the simulator), ``compiler.views`` (index decomposition, view
layouts), ``kernels.rewrites`` (dead steps, LX reuse, multi-pass
rows) and ``kernels.plan`` (core split, tiles, the cost-driven search).
"""

from __future__ import annotations

import math
from dataclasses import replace

import sympy
import torch

from torch_spyre.compiler import lanes, pieces, trig
from torch_spyre.compiler.kernel_plan import OperandUse, Plan
from torch_spyre.compiler.lane_steps import LaneSteps
from torch_spyre.compiler.values import Scal, Val
from torch_spyre.compiler.vector_ops import _BINARY, _PY_BINARY, _UNARY, COMPARISONS
from torch_spyre.compiler.views import (
    _decompose,
    _stored_layout,
    is_ghost,
    strided_view,
    view_layout,
)
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Buffer, Load, Matmul, Reduce, Store, Vector
from torch_spyre.ir.vector_ops import aten_unary
from torch_spyre.kernels import plan as planner
from torch_spyre.kernels.plan import _dkey
from torch_spyre.kernels.rewrites import _live, _rename_step, _reuse_buffers
from torch_spyre.kernels.search import Unsupported
from torch_spyre.layout import FP8_DTYPES, SpyreTensorLayout, stick_elems


class ReadShape(Unsupported):
    """A value this program wrote is read in another factorisation of its dims
    (a matmul's rows written as ``b*s`` x heads, read as b x s x heads): the
    reader's pieces, per dim, so that the writer can be planned in them
    (``scheduling._plan`` plans an absorbed matmul's output so)."""

    def __init__(self, buffer: str, pieces: list[list[int]]) -> None:
        super().__init__(f"{buffer} is read in another shape than it was written")
        self.buffer, self.pieces = buffer, pieces


_LN2 = math.log(2.0)


def _default_numel(size, dtype) -> int:
    return SpyreTensorLayout.default(tuple(size) or (1,), dtype).device_numel


def _lx_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


# ------------------------------------------------------------------ builder
class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        p = self.parent.setdefault(x, x)
        if p != x:
            p = self.parent[x] = self.find(p)
        return p

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class ProgramBuilder(LaneSteps):
    """Records kernel-program steps while Inductor's inner functions run on it."""

    def __init__(
        self, buffer_info, config: HardwareConfig | None = None, simplify=None, naive: bool = False
    ) -> None:
        self._simplify = simplify
        #: plan as a naive backend would (``kernels.options.planning(naive=True)``)
        self.naive = naive
        #: name -> (size, stride, offset, dtype) of every Inductor buffer / graph input
        self.buffer_info = buffer_info
        self.cfg = config or HardwareConfig()
        self.steps: list = []
        self.buffers: dict[str, Buffer] = {}
        self.ranges: dict[str, int] = {}
        self.order: list[str] = []
        self.reduced: set[str] = set()
        self.uf = _UnionFind()
        self.operands: dict[tuple, OperandUse] = {}
        #: buffers stored in this group: name -> (value, per-dim variables)
        self.produced: dict[str, tuple[Val, list[list[str]]]] = {}
        self.store_steps: dict[str, int] = {}
        self.cse: dict[tuple, Val] = {}
        #: operand -> (index variables, tile) of each load of it in this group
        self.load_index: dict[str, list[tuple[tuple[str | None, ...], Val]]] = {}
        #: buffers holding an affine function of the loop variables (index_expr)
        self.affine: dict[str, sympy.Expr] = {}
        #: the lane dim of each stick read one element at a time (see _lane)
        self.lane_vars: dict[tuple, str] = {}
        #: 0-dim buffers (their operands are 1-element vectors)
        self.scalars: set[str] = set()
        self._n = 0
        self.node_vars: list[str] = []
        #: the FX nodes the node being lowered computes (``lane_steps._finite``)
        self.node_origins: tuple = ()
        #: (buffer, layout) -> modelled seconds of the kernels reading a
        #: stored buffer in that layout (``compiler.layouts.consumers_cost``)
        self.readers_cost = None

    # ------------------------------------------------------------ helpers
    def simplify(self, expr):
        return self._simplify(expr, self.ranges) if self._simplify else expr

    def new_vars(self, prefix: str, sizes) -> list:
        out = []
        for s in sizes:
            s = int(s)
            if s == 1:
                out.append(sympy.Integer(0))
                continue
            name = f"{prefix}{self._n}"
            self._n += 1
            self.ranges[name] = s
            self.order.append(name)
            out.append(sympy.Symbol(name, integer=True, nonnegative=True))
        return out

    def _buf(self, dims, dtype, double=False) -> str:
        name = f"t{len(self.buffers)}"
        self.buffers[name] = Buffer(name, tuple(sorted(dims)), dtype, double)
        return name

    def _info(self, name: str):
        try:
            size, stride, offset, dtype = self.buffer_info(name)
        except KeyError:
            raise Unsupported(f"buffer {name!r} has no fixed layout") from None
        if not size:  # a scalar is stored as a 1-element vector
            self.scalars.add(name)
            return (1,), (1,), offset, dtype
        return size, stride, offset, dtype

    def _size(self, v: str) -> int:
        return int(v[1:]) if is_ghost(v) else self.ranges[v]

    def _operand(self, buffer: str, role: str, factors, offsets, size, dtype) -> OperandUse:
        shape_f = [[self._size(v) for v in f] for f in factors]
        ghosts = [[i for i, v in enumerate(f) if is_ghost(v)] for f in factors]
        key = (buffer, role, tuple(tuple(f) for f in shape_f), tuple(offsets))
        use = self.operands.get(key)
        if use is None:
            load_offsets: tuple[int, ...] = ()
            stored = _stored_layout(buffer)
            if stored is not None:  # not the default: read or written whole only
                plain = not any(offsets) and all(
                    f == [n] if n > 1 else f in ([], [1]) for f, n in zip(shape_f, size)
                )
                if not plain:
                    raise Unsupported(f"a view of {buffer}, which is stored in {stored}")
                lay, start = stored, 0
            else:
                try:
                    if any(ghosts):  # pieces read at one position: a sub-block read
                        raise Unsupported(f"a strided read of {buffer}")
                    lay, start = view_layout(tuple(size), dtype, shape_f, offsets)
                except Unsupported:
                    if role != "input":
                        raise
                    lay, load_offsets = strided_view(tuple(size), dtype, shape_f, offsets, ghosts)
                    start = 0
            if role == "output" and (start or lay.device_numel != _default_numel(size, dtype)):
                raise Unsupported(f"a store into part of {buffer}")
            if start < 0:  # sticks before the tensor's first element: not its memory
                raise Unsupported(f"a read of {buffer} that starts before its first element")
            shape = () if buffer in self.scalars else tuple(size)
            use = OperandUse(
                f"{role[:2]}{len(self.operands)}", buffer, role, lay, shape, start, load_offsets
            )
            self.operands[key] = use
        return use

    @staticmethod
    def _index(factors) -> tuple[str | None, ...]:
        idx: list[str | None] = []
        for f in factors:
            idx.extend([None if is_ghost(v) else v for v in f] if f else [None])
        return tuple(idx)

    def _vec(self, op: str, inputs: list[Val], scalars=(), dtype=torch.float32) -> Val:
        key = (op, tuple(v.buf for v in inputs), tuple(scalars), dtype)
        hit = self.cse.get(key)
        if hit is not None:
            return hit
        dims = frozenset().union(*(v.dims for v in inputs)) if inputs else frozenset()
        out = self._buf(dims, dtype)
        self.steps.append(Vector(op, out, tuple(v.buf for v in inputs), tuple(scalars)))
        val = Val(out, dims, dtype)
        self.cse[key] = val
        return val

    def _materialise(self, x) -> Val:
        if isinstance(x, Val):
            return x
        dt = _lx_dtype(x.dtype)
        v = self._vec("fill", [], (float(x.value),), torch.float32)
        return v if dt == torch.float32 else self._vec("copy", [v], (), dt)

    # ------------------------------------------------------ ops handler API
    def load(self, name: str, index, share: bool = True) -> Val:
        """``share``: reuse a tile of the same operand already loaded by this
        group (unifying their dims); a matmul's operands are never shared, since
        their k dim is not the epilogue's."""
        size, stride, offset, dtype = self._info(name)
        index = self.simplify(index)
        se = stick_elems(dtype)
        try:
            factors, offs = _decompose(index, size, stride, offset, self.ranges, f"load of {name}")
            stick = [v for v in factors[-1] if not is_ghost(v)]
            if (
                name not in self.produced
                and len(stick) < len(factors[-1])
                and self.ranges[stick[-1]] % se
            ):
                # ghost pieces around a sub-stick piece (a fused qkv's heads of
                # 16): not a view of whole sticks, the pieces / lanes paths read it
                raise Unsupported(f"load of {name}: sub-stick pieces between ghosts")
        except Unsupported:
            if name in self.produced:
                raise
            try:  # a sub-block of the pieces of a reshaped dim (compiler/pieces.py)
                dims = pieces.decompose(index, size, stride, offset, self.ranges, dtype)
                return self._load_pieces(name, dims, size, dtype)
            except (pieces.PiecesError, Unsupported):
                pass
            got = lanes.stick_terms(index, size, stride, offset, self.ranges)
            if got is None:
                raise
            rest, terms, first = got
            return self._gather(name, rest, terms, first, size, stride, offset, dtype, se)
        if name not in self.produced and not factors[-1] and size[-1] > 1 and offs[-1] % se:
            return self._lane(name, factors, offs, size, dtype, se)
        # (ghost pieces, read at one position, are whole-stick blocks: a view)
        if (
            name not in self.produced
            and factors[-1]
            and size[-1] > 1
            and not any(is_ghost(v) for v in factors[-1])
        ):
            widths = [self.ranges[v] for v in factors[-1]]
            if lanes.needs_gather(size[-1], widths, offs[-1], se):
                terms, c = [], 1
                for v in reversed(factors[-1]):
                    terms.insert(0, (v, c))
                    c *= self.ranges[v]
                rest = sympy.expand(
                    index
                    - offset
                    - sum(sympy.Symbol(v, integer=True, nonnegative=True) * k for v, k in terms)
                    - offs[-1]
                )
                return self._gather(name, rest, terms, offs[-1], size, stride, offset, dtype, se)
        if name in self.produced:
            val, pf = self.produced[name]
            if any(offs) or any(is_ghost(v) for f in factors for v in f):
                raise Unsupported(f"{name} is read in part after it was written")
            for a, b in zip(pf, factors):
                if [self.ranges[v] for v in a] != [self.ranges[v] for v in b]:
                    raise ReadShape(
                        name, [[self.ranges[v] for v in f if not is_ghost(v)] for f in factors]
                    )
            pairs = [(x, y) for a, b in zip(pf, factors) for x, y in zip(a, b)]
            if not self._one_iteration(pairs):
                raise Unsupported(f"{name} is read at other indices than it was written")
            for x, y in pairs:
                self.uf.union(x, y)
            return val
        return self._load_parts(name, factors, offs, size, dtype, share)

    def _load_parts(self, name: str, factors, offs, size, dtype, share: bool = True) -> Val:
        use = self._operand(name, "input", factors, offs, size, dtype)
        idx = self._index(factors)
        if share:
            hit = self._loaded(use.name, idx)
            if hit is not None:
                return hit
        dims = frozenset(d for d in idx if d is not None)
        buf = self._buf(dims, dtype, double=True)
        self.steps.append(Load(buf, use.name, idx, offsets=use.load_offsets))
        val = Val(buf, dims, dtype)
        if share:
            self.load_index.setdefault(use.name, []).append((idx, val))
        return val

    def _loaded(self, operand: str, idx) -> Val | None:
        """A tile of ``operand`` this group loaded already that serves a load at
        ``idx``: the one at the same variables, else one a later node of the
        group reads as its own (its variables are unified with this node's).
        The same operand at other variables of this node (``x[i] * x[j]``, a
        tensor broadcast against itself) is another load."""
        seen = self.load_index.get(operand, [])
        for prev, val in seen:
            if all(
                (x is None) == (y is None) and (x is None or self.uf.find(x) == self.uf.find(y))
                for x, y in zip(prev, idx)
            ):
                return val
        for prev, val in seen:
            if any((x is None) != (y is None) for x, y in zip(prev, idx)):
                # a dim read at one position is not the tile of all of it
                # (softmax over a dim of 2, unrolled: x[:, 0] is no x[:, j];
                # fuzzer seed 800418, a wrong answer)
                continue
            pairs = [(x, y) for x, y in zip(prev, idx) if x is not None and y is not None]
            if self._one_iteration(pairs):
                for x, y in pairs:
                    self.uf.union(x, y)
                return val
        return None

    def _one_iteration(self, pairs) -> bool:
        """Whether the index variables ``pairs`` name may be unified: a variable
        of an earlier node of the group is this node's corresponding one, but
        two distinct variables of this node are different elements."""
        mine = {self.uf.find(v) for v in self.node_vars}
        return all(
            self.uf.find(x) == self.uf.find(y)
            or not (self.uf.find(x) in mine and self.uf.find(y) in mine)
            for x, y in pairs
        )

    def _load_pieces(self, name: str, dims, size, dtype) -> Val:
        """The whole buffer viewed in pieces, loaded from per-piece offsets."""
        psizes = [p for ps, _, _ in dims for p in ps]
        offs = tuple(o for _, _, os_ in dims for o in os_)
        idx = tuple(v for _, vs, _ in dims for v in vs)
        key = ("pieces", name, tuple(tuple(ps) for ps, _, _ in dims), offs)
        use = self.operands.get(key)
        if use is None:
            stored = _stored_layout(name)
            if stored is not None:  # pieces are views of the default layout only
                raise Unsupported(f"a view of {name} in pieces, which is stored in {stored}")
            lay, start = view_layout(tuple(size), dtype, [ps for ps, _, _ in dims])
            if start or lay.device_numel != _default_numel(size, dtype):
                raise Unsupported(f"a view of {name} in pieces {psizes}")
            shape = () if name in self.scalars else tuple(size)
            use = OperandUse(f"in{len(self.operands)}", name, "input", lay, shape, 0, offs)
            self.operands[key] = use
        hit = self._loaded(use.name, idx)
        if hit is not None:
            return hit
        vdims = frozenset(d for d in idx if d is not None)
        buf = self._buf(vdims, dtype, double=True)
        self.steps.append(Load(buf, use.name, idx, offsets=offs))
        val = Val(buf, vdims, dtype)
        self.load_index.setdefault(use.name, []).append((idx, val))
        return val

    def store(self, name: str, index, value, mode=None) -> None:
        if mode is not None:
            raise Unsupported(f"store mode {mode!r} into {name}")
        size, stride, offset, dtype = self._info(name)
        index = self.simplify(index)
        factors, offs = _decompose(index, size, stride, offset, self.ranges, f"store of {name}")
        if any(is_ghost(v) for f in factors for v in f):
            raise Unsupported(f"a strided store into {name}")
        if isinstance(value, Scal):  # a fill: the constant, broadcast below
            value = self._materialise(value)
        idx_dims = {self.uf.find(v) for f in factors for v in f}
        vdims = {self.uf.find(v) for v in value.dims}
        if not idx_dims >= vdims:
            raise Unsupported(
                f"store into {name}: value has dims the output lacks "
                f"({sorted(vdims - idx_dims)} not in {sorted(idx_dims)})"
            )
        for v in sorted({v for f in factors for v in f}):
            if self.uf.find(v) not in vdims:  # a repeat / expand: broadcast in LX
                value = self._vec("bcast", [value, self._iota(v)], (), value.dtype)
                vdims.add(self.uf.find(v))
        se = stick_elems(dtype)
        widths = [self.ranges[v] for v in factors[-1]]
        if (
            len(widths) > 1
            and name not in self.scalars
            and lanes.needs_gather(size[-1], widths, offs[-1], se)
        ):  # sub-stick pieces of the stick dim: placed on lanes (lane_steps)
            if offs[-1]:
                raise Unsupported(f"a store into part of the stick dim of {name}")
            factors, value = self._scatter(name, factors, value, size, dtype)
        use = self._operand(name, "output", factors, offs, size, dtype)
        self.produced[name] = (value, factors)
        self.store_steps[name] = len(self.steps)
        self.steps.append(Store(use.name, value.buf, self._index(factors)))

    def store_reduction(self, name: str, index, value) -> None:
        self.store(name, index, value)

    def reduction(self, dtype, src_dtype, reduction_type, value):
        rvars = [v for v in self.node_rvars]
        if isinstance(value, tuple):
            raise Unsupported(f"reduction {reduction_type} of several values")
        value = self._materialise(value)
        if reduction_type in ("sum", "max", "min", "prod"):
            return self._reduce(reduction_type, value, rvars, _lx_dtype(dtype))
        if reduction_type in ("argmax", "argmin") and len(rvars) == 1:
            # the first position of the extreme: the max (min), then the least
            # index where the row equals it (two associative passes, so a row
            # split over cores or tiles stays exact)
            m = self._reduce(reduction_type[3:], value, rvars, torch.float32)
            hit = self._vec("eq", [value, m], (), torch.bool)
            n = Scal(float(self.ranges[rvars[0]]), torch.float32)
            first = self._vec("where", [hit, self._iota(rvars[0]), self._materialise(n)])
            return self._reduce("min", first, rvars, _lx_dtype(dtype))
        if reduction_type == "any":
            return self._reduce("any", value, rvars, torch.bool)
        if reduction_type == "welford_reduce":
            n = math.prod(self.ranges[v] for v in rvars)
            s = self._reduce("sum", value, rvars, torch.float32)
            mean = self._vec("mul_scalar", [s], (1.0 / n,))
            xc = self._vec("sub", [value, mean])
            sq = self._vec("square", [xc])
            m2 = self._reduce("sum", sq, rvars, torch.float32)
            return (mean, m2, Scal(float(n), torch.float32))
        raise Unsupported(f"reduction {reduction_type!r}")

    def _reduce(self, op: str, value: Val, rvars, dtype) -> Val:
        for r in reversed(rvars):  # innermost first: the outer one may be streamed
            same = [d for d in value.dims if self.uf.find(d) == self.uf.find(r)]
            r = same[0] if same else r
            if r not in value.dims:
                if op == "sum":  # a sum of a value constant along r
                    value = self._vec("mul_scalar", [value], (float(self.ranges[r]),))
                elif op == "prod":  # a product of one value n times (an expanded input)
                    value = self._vec("pow_scalar", [value], (float(self.ranges[r]),))
                elif op not in ("max", "min", "any"):
                    raise Unsupported(f"a {op} reduction of a value constant along {r}")
                continue
            key = ("reduce", op, value.buf, r)
            hit = self.cse.get(key)
            if hit is None:
                dims = frozenset(d for d in value.dims if self.uf.find(d) != self.uf.find(r))
                out = self._buf(dims, dtype)
                self.steps.append(Reduce(op, out, value.buf, r))
                hit = self.cse[key] = Val(out, dims, dtype)
            self.reduced.add(r)
            value = hit
        return value

    def matmul(self, a: Val, b: Val, kvars: list[str]) -> Val:
        """A PE-array contraction of ``a`` and ``b`` over ``kvars`` (fp32 accumulation)."""
        # contracted: the k variables and any unified with them (an operand
        # computed in this group, a weight's prologue, has its own names)
        ks = {self.uf.find(k) for k in kvars}
        dims = frozenset(d for d in a.dims | b.dims if self.uf.find(d) not in ks)
        out = self._buf(dims, torch.float32)
        self.steps.append(Matmul(out, a.buf, b.buf))
        self.reduced.update(kvars)
        return Val(out, frozenset(dims), torch.float32)

    def constant(self, value, dtype) -> Scal:
        return Scal(value, dtype)

    def index_expr(self, expr, dtype):
        """An affine index expression as a value: iota tables (constant device
        operands, one per dim) scaled and summed on the vector unit."""
        expr = sympy.expand(sympy.sympify(self.simplify(expr)))
        if expr.is_number:
            # a size expression (an attention's 1/sqrt(head dim) under
            # automatic dynamic shapes, its size specialised): whole, or a
            # float for a float value (int() truncated 0.38 to 0, a wrong answer)
            if expr.is_integer:
                return Scal(int(expr), dtype)
            if not dtype.is_floating_point:
                raise Unsupported(f"index expression {expr} as a {dtype} value")
            return Scal(float(expr), dtype)
        acc = None
        rest = expr
        for s in sorted(expr.free_symbols, key=lambda x: x.name):
            c = expr.coeff(s)
            if not c.is_Integer or s.name not in self.ranges:
                raise Unsupported(f"index expression {expr} as a value")
            rest = rest - c * s
            v = self._iota(s.name)
            if int(c) != 1:
                v = self._vec("mul_scalar", [v], (float(c),))
            acc = v if acc is None else self._vec("add", [acc, v])
        rest = sympy.expand(rest)
        if not rest.is_number:
            raise Unsupported(f"index expression {expr} as a value")
        if rest != 0:
            acc = self._vec("add_scalar", [acc], (float(rest),))
        self.affine[acc.buf] = expr
        return acc

    def indirect_indexing(self, x, size, check=True, wrap_neg=True):
        """An index read from a value: only an affine function of the loop
        variables (``mask[arange(b), arange(n)]``, as transformers indexes its
        padding mask) is an index; a gather has no DMA form in a program."""
        if isinstance(x, Scal):  # a constant index (Falcon's qkv[:, :, [-2]])
            v = int(x.value)
            if v < 0 and wrap_neg:
                v += int(size)
            if check and not 0 <= v < int(size):
                raise Unsupported(f"index {int(x.value)} is out of bounds for a dim of size {size}")
            return sympy.Integer(v)
        expr = self.affine.get(x.buf) if isinstance(x, Val) else None
        if expr is None:
            raise Unsupported(
                "a gather (an index read from data) inside a kernel program; "
                "only embedding and index_put run as device kernels"
            )
        return expr

    def _iota(self, var: str) -> Val:
        n = self.ranges[var]
        key = ("iota", n)
        use = self.operands.get(key)
        if use is None:
            lay = SpyreTensorLayout.default((n,), torch.float32)
            use = OperandUse(f"io{len(self.operands)}", f"iota:{n}", "iota", lay, (n,))
            self.operands[key] = use
        ck = ("load-iota", use.name, var)
        hit = self.cse.get(ck)
        if hit is None:
            buf = self._buf({var}, torch.float32, double=True)
            self.steps.append(Load(buf, use.name, (var,)))
            hit = self.cse[ck] = Val(buf, frozenset({var}), torch.float32)
        return hit

    def to_dtype(self, x, dtype, src_dtype=None, use_compute_types=True):
        if isinstance(x, Scal):
            return Scal(x.value, dtype)
        if dtype in FP8_DTYPES:
            # an 8-bit float is data, not a compute type: the conversion rounds
            # (the vector unit's fp16 -> fp8 conversion, from a 16-bit value:
            # a 16-bit source is rounded to it first, as the graph says)
            if x.dtype in FP8_DTYPES:
                return x if x.dtype == dtype else self._vec("copy", [x], (), dtype)
            if src_dtype in (torch.float16, torch.bfloat16) and x.dtype == torch.float32:
                x = self._vec("copy", [x], (), src_dtype)
            return self._vec("copy", [x], (), dtype)
        want = _lx_dtype(dtype)
        if want == x.dtype:
            return x
        out = self._vec("copy", [x], (), want)
        if x.buf in self.affine:
            self.affine[out.buf] = self.affine[x.buf]
        return out

    def where(self, cond, a, b):
        if isinstance(cond, Scal):  # a condition folded on the host
            return a if bool(cond.value) else b
        vals = [self._materialise(v) for v in (cond, a, b)]
        dt = vals[1].dtype if vals[1].dtype.is_floating_point else torch.float32
        return self._vec("where", vals, (), dt)

    def sin(self, x):
        return trig.trig(self, x, cos=False)

    def cos(self, x):
        return trig.trig(self, x, cos=True)

    def _unary(self, op: str, x):
        if isinstance(x, Scal):
            t = getattr(torch, op)(torch.tensor(float(x.value)))
            return Scal(t.item(), x.dtype)
        dt = torch.bool if op in ("logical_not", "isinf", "isnan") else torch.float32
        return self._vec(_UNARY[op], [x], (), dt)

    def _aten_unary(self, name: str, vop: str, x):
        if isinstance(x, Scal):
            return Scal(getattr(torch.ops.aten, name)(torch.tensor(float(x.value))).item(), x.dtype)
        return self._vec(vop, [self._materialise(x)], (), torch.float32)

    def _affine_of(self, x):
        if isinstance(x, Scal):
            v = x.value
            return sympy.Integer(int(v)) if float(v).is_integer() else None
        return self.affine.get(x.buf) if isinstance(x, Val) else None

    def _binary(self, op: str, a, b):
        out = self._binary_op(op, a, b)
        # index arithmetic (iota + offset, scaled) stays an index
        if op in ("add", "sub", "mul") and isinstance(out, Val):
            ea, eb = self._affine_of(a), self._affine_of(b)
            if ea is not None and eb is not None and (op != "mul" or ea.is_number or eb.is_number):
                e = ea + eb if op == "add" else ea - eb if op == "sub" else ea * eb
                self.affine[out.buf] = sympy.expand(e)
        return out

    def _binary_op(self, op: str, a, b):
        if isinstance(a, Scal) and isinstance(b, Scal):
            if op in _PY_BINARY:  # folded on the host (a mask of two constant bounds)
                dtype = torch.bool if op in COMPARISONS else a.dtype
                return Scal(_PY_BINARY[op](a.value, b.value), dtype)
            raise Unsupported(f"{op} of two constants")
        out_bool = op in ("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or")
        if isinstance(b, Scal) and not out_bool:
            c = float(b.value)
            if op == "add":
                return self._vec("add_scalar", [a], (c,))
            if op == "sub":
                return self._vec("add_scalar", [a], (-c,))
            if op == "mul":
                return self._vec("mul_scalar", [a], (c,))
            if op in ("truediv", "div") and c != 0:
                return self._vec("mul_scalar", [a], (1.0 / c,))
            if op == "maximum":
                return self._vec("maximum_scalar", [a], (c,))
            if op == "minimum":
                return self._vec("minimum_scalar", [a], (c,))
            if op == "pow":
                return self._vec("pow_scalar", [a], (c,))
        if isinstance(a, Scal) and not out_bool:
            c = float(a.value)
            if op == "add":
                return self._vec("add_scalar", [b], (c,))
            if op == "mul":
                return self._vec("mul_scalar", [b], (c,))
            if op == "sub":
                return self._vec("add_scalar", [self._vec("neg", [b])], (c,))
            if op in ("truediv", "div"):
                r = self._vec("reciprocal", [b])
                return r if c == 1.0 else self._vec("mul_scalar", [r], (c,))
            if op == "maximum":
                return self._vec("maximum_scalar", [b], (c,))
            if op == "minimum":
                return self._vec("minimum_scalar", [b], (c,))
        a, b = self._materialise(a), self._materialise(b)
        if op in ("truediv", "div") and {self.uf.find(d) for d in b.dims} < {
            self.uf.find(d) for d in a.dims
        }:
            # a divisor with fewer elements (softmax's row sums): one
            # reciprocal per divisor element, then a multiply per element
            return self._vec("mul", [a, self._vec("reciprocal", [b])])
        return self._vec(_BINARY[op], [a, b], (), torch.bool if out_bool else torch.float32)

    def _bitwise(self, name: str, *args):
        """bitwise_and/or/not of booleans (masks combined) are the logical ops;
        integer bit operations have no vector-unit equivalent here."""
        vals = [a for a in args if isinstance(a, Val | Scal)]
        if not all(v.dtype == torch.bool for v in vals):
            raise Unsupported(f"op {name!r} on integers")
        if name == "bitwise_not":
            return self._unary("logical_not", args[0])
        return self._binary("logical_and" if name == "bitwise_and" else "logical_or", *args)

    def __getattr__(self, name: str):
        if name in ("bitwise_and", "bitwise_or", "bitwise_not"):
            return lambda *args: self._bitwise(name, *args)
        if name in _UNARY:
            return lambda x, *rest: self._unary(name, x)
        if name == "exp2":  # 2^x = e^(x ln 2)
            return lambda x, *rest: self._unary("exp", self._binary("mul", x, Scal(_LN2, x.dtype)))
        if name in _BINARY:
            return lambda a, b: self._binary(name, a, b)
        if name.startswith("_"):
            raise AttributeError(name)
        vop = aten_unary(name)
        if vop is not None:  # acos, atan, log2, ...: the eager library's vector op
            return lambda x, *rest: self._aten_unary(name, vop, x)

        def unsupported(*args, **kwargs):
            raise Unsupported(f"op {name!r}")

        return unsupported

    # ------------------------------------------------------------ finishing
    def finish(self, name: str, keep: set[str], allow_lx: bool) -> Plan:
        """The program: unify dims, drop stores of group-internal buffers,
        reuse LX buffers, choose the core split and tiles."""
        removed = set()
        drop = set()
        for buf, pos in self.store_steps.items():
            if buf not in keep and allow_lx:
                drop.add(pos)
                removed.add(buf)
        steps = _live([s for i, s in enumerate(self.steps) if i not in drop])
        used_ops = {s.operand for s in steps if isinstance(s, Load | Store)}
        ops = [u for u in self.operands.values() if u.name in used_ops]
        # canonical dim names
        canon: dict[str, str] = {}
        for v in self.order:
            r = self.uf.find(v)
            if r not in canon:
                canon[r] = f"d{len(canon)}"
        ren = {v: canon[self.uf.find(v)] for v in self.order}
        for v in self.order:
            if self.ranges[v] != self.ranges[self.uf.find(v)]:
                raise Unsupported("a fused dim with two sizes")
        sizes = {ren[v]: self.ranges[v] for v in self.order}
        reduced = {ren[v] for v in self.reduced}
        steps = [_rename_step(s, ren) for s in steps]
        buffers = {
            n: replace(b, dims=tuple(sorted({ren[d] for d in b.dims}, key=_dkey)))
            for n, b in self.buffers.items()
        }
        pre_steps, pre_buffers = steps, buffers
        steps, buffers = _reuse_buffers(steps, buffers)
        # stored buffers are double buffered, so the tile loop is a pipeline
        # (the store of one tile overlaps the compute of the next)
        for st in steps:
            if isinstance(st, Store) and not buffers[st.buffer].double_buffered:
                buffers[st.buffer] = replace(buffers[st.buffer], double_buffered=True)
        # the steps before LX reuse: rows longer than the LX are re-planned
        # from them as several passes (``_multipass``)
        streamed = (tuple(pre_steps), tuple(pre_buffers.items())) if reduced else None
        prog = planner._plan_dims(
            name, steps, buffers, ops, sizes, reduced, self.cfg, self.naive,
            streamed=streamed,
        )  # fmt: skip
        plan = Plan(prog, ops, removed)
        if not self.naive and not any(isinstance(s, Matmul) for s in steps):
            # the stick dim of each input operand, chosen by cost (restickify)
            from torch_spyre.compiler import layouts

            def replan(ops2):
                return planner._plan_dims(
                    name, steps, buffers, ops2, sizes, reduced, self.cfg, self.naive, streamed
                )

            if self.readers_cost is not None:  # computed intermediates: producer's choice
                plan = layouts.choose_output(plan, replan, self.readers_cost, self.cfg)
            plan = layouts.choose(plan, replan, self.buffer_info, self.cfg)
        return plan
