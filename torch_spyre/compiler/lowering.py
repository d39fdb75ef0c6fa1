"""Inductor loop IR -> one kernel program per fused group of scheduler nodes.

Each scheduler node's store function (``ComputedBuffer.get_store_function``)
is evaluated over its *unsimplified* ranges with an ops handler that records
kernel-program steps instead of printing code:

* every iteration variable becomes a named program dim; ``load``/``store``
  index expressions are decomposed into "host dim k of the buffer is indexed
  by variable v" (``_decompose``), so operands keep their stick layouts; a
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
* LX buffers are reused by liveness (``_reuse_buffers``) and the tile of
  every loop dim is shrunk until the whole working set, double-buffered
  loads/stores included, fits half the LX (``_plan_dims``);
* the core split takes the non-reduced dims with the most parallel work,
  the stick dim of stored operands only in whole sticks.

Anything the handler cannot express raises ``Unsupported`` naming the op;
the scheduling then plans the nodes one by one, and a node that still fails
stops compilation with that message (there is no silent host fallback
inside a compiled region).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import sympy
import torch

from torch_spyre.compiler import lanes, pieces, trig
from torch_spyre.layout import FP8_DTYPES, SpyreTensorLayout, ceil_div, stick_elems
from torch_spyre.sim import (
    Buffer,
    Dim,
    HardwareConfig,
    Load,
    Matmul,
    Operand,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    Store,
    Vector,
    estimate,
)
from torch_spyre.sim import ops as sim_ops
from torch_spyre.sim.program import step_reads, step_writes


class Unsupported(NotImplementedError):
    """The planner cannot express this in a kernel program (the message says what)."""


# ----------------------------------------------------------- vector ops we add
def _register_ops() -> None:
    """Vector ops the compiler needs beyond the stock set (append-only)."""
    new = [
        ("erf", torch.erf, "transcendental", 1),
        ("maximum_scalar", lambda x, s: torch.clamp_min(x, s), "simple", 1),
        ("minimum_scalar", lambda x, s: torch.clamp_max(x, s), "simple", 1),
        ("where", torch.where, "simple", 3),
        ("lt", torch.lt, "simple", 2),
        ("le", torch.le, "simple", 2),
        ("gt", torch.gt, "simple", 2),
        ("ge", torch.ge, "simple", 2),
        ("eq", torch.eq, "simple", 2),
        ("ne", torch.ne, "simple", 2),
        ("logical_and", torch.logical_and, "simple", 2),
        ("logical_or", torch.logical_or, "simple", 2),
        ("logical_not", torch.logical_not, "simple", 1),
        ("pow", torch.pow, "transcendental", 2),
        ("log1p", torch.log1p, "transcendental", 1),
        ("expm1", torch.expm1, "transcendental", 1),
        ("sign", torch.sign, "simple", 1),
        # T5's fp16 overflow guard: isinf(x).any() picks the clamp bound
        ("isinf", torch.isinf, "simple", 1),
        # range reduction of sin/cos (compiler/trig.py)
        ("round", torch.round, "simple", 1),
        # modular index arithmetic (a rolled sliding-window cache): a division
        ("fmod", torch.fmod, "transcendental", 2),
        ("remainder", torch.remainder, "transcendental", 2),
        ("isnan", torch.isnan, "simple", 1),
        ("fill", lambda v: torch.tensor(v, dtype=torch.float32), "simple", 0),
        # the first input repeated along the dims of the second (which only gives shape)
        ("bcast", lambda a, b: torch.broadcast_tensors(a, b)[0], "simple", 2),
    ]
    for name, fn, cost, n in new:
        if name not in sim_ops.VECTOR_OPS:
            sim_ops.register_op(name, fn, cost, n)
    if "any" not in sim_ops.REDUCTIONS:
        sim_ops.register_reduction("any", lambda x, d: x.bool().any(d), 0.0)
    if "logsumexp" not in sim_ops.REDUCTIONS:
        # online softmax statistics of a streamed row (``_online_softmax``): a
        # running max m and sum s, rescaled by exp(m_old - m_new) per tile;
        # per input stick: max, subtract, exp, accumulate
        sim_ops.register_reduction(
            "logsumexp",
            lambda x, d: torch.logsumexp(x, d),
            -math.inf,
            extra_cost=("simple", "simple", "transcendental"),
        )


_register_ops()

_UNARY = {
    "exp": "exp",
    "log": "log",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "reciprocal": "reciprocal",
    "neg": "neg",
    "abs": "abs",
    "relu": "relu",
    "erf": "erf",
    "log1p": "log1p",
    "expm1": "expm1",
    "sign": "sign",
    "logical_not": "logical_not",
    "isinf": "isinf",
    "isnan": "isnan",
    "square": "square",
    "silu": "silu",
}
_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "truediv": "div",
    "div": "div",
    "maximum": "maximum",
    "minimum": "minimum",
    "lt": "lt",
    "le": "le",
    "gt": "gt",
    "ge": "ge",
    "eq": "eq",
    "ne": "ne",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "pow": "pow",
    "mod": "fmod",  # Inductor's ops.mod: C semantics (the sign of the dividend)
    "fmod": "fmod",
    "remainder": "remainder",
}
_PY_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b,
    "div": lambda a, b: a / b,
    "maximum": max,
    "minimum": min,
    "pow": lambda a, b: a**b,
}


# ----------------------------------------------------------------- values
@dataclass(frozen=True)
class Val:
    """A value in an LX buffer, indexed by iteration variables."""

    buf: str
    dims: frozenset[str]
    dtype: torch.dtype


@dataclass(frozen=True)
class Scal:
    value: float | int | bool
    dtype: torch.dtype


def _default_numel(size, dtype) -> int:
    return SpyreTensorLayout.default(tuple(size) or (1,), dtype).device_numel


def _lx_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


# ------------------------------------------------------- index decomposition
def _decompose(index, sizes, strides, offset, ranges: dict[str, int], what: str):
    """How an affine index reads a buffer: per buffer dim, the variables that
    index it (outer to inner) and the element offset the read starts at.

    Raises ``Unsupported`` for anything else (non-affine, dims mixed, reads
    outside the buffer)."""
    index = sympy.expand(sympy.sympify(index) - offset)
    coeff: dict[str, int] = {}
    rest = index
    for s in index.free_symbols:
        c = index.coeff(s)
        if not c.is_Integer:
            raise Unsupported(f"{what}: non-affine index {index}")
        coeff[s.name] = int(c)
        rest = rest - c * s
    rest = sympy.expand(rest)
    if not rest.is_Integer:
        raise Unsupported(f"{what}: non-affine index {index}")
    per_dim: list[list[str]] = [[] for _ in sizes]
    for name, c in coeff.items():
        if c == 0 or ranges.get(name, 1) == 1:
            continue
        hit = None
        for j, (sz, st) in enumerate(zip(sizes, strides)):
            if sz > 1 and st > 0 and c % st == 0 and st <= c < st * sz:
                hit = j
                break
        if hit is None:
            raise Unsupported(f"{what}: index {index} does not follow the buffer's strides")
        per_dim[hit].append(name)
    offsets = [0] * len(sizes)
    rem = int(rest)
    for j in sorted(range(len(sizes)), key=lambda j: -strides[j]):
        if sizes[j] > 1 and strides[j] > 0:
            offsets[j], rem = divmod(rem, strides[j])
    if rem:
        raise Unsupported(f"{what}: index {index} starts between elements")
    out: list[list[str]] = []
    for j, (sz, st) in enumerate(zip(sizes, strides)):
        vs = sorted(per_dim[j], key=lambda n: -coeff[n])
        expect = st
        pieces: list[str] = []
        for n in reversed(vs):
            if coeff[n] != expect:
                # a gap between two variables (x[t, h, 0, :] of a [t, h*2*64] buffer:
                # every other block of sticks): a ghost piece read at one position
                if not pieces or coeff[n] % expect:
                    raise Unsupported(f"{what}: index {index} mixes dims of the buffer")
                pieces.append(ghost(coeff[n] // expect))
                expect = coeff[n]
            pieces.append(n)
            expect *= ranges[n]
        vs = pieces[::-1]
        last = offsets[j] + sum((ranges[n] - 1) * coeff[n] // st for n in vs if not is_ghost(n))
        if last >= max(sz, 1):
            raise Unsupported(f"{what}: index {index} reads past dim {j} of the buffer")
        out.append(vs)
    return out, offsets


def ghost(n: int) -> str:
    """A piece of a buffer dim that a load skips over (read at one position)."""
    return f"~{n}"


def is_ghost(v: str) -> bool:
    return v.startswith("~")


def view_layout(size, dtype, factors, offsets=None):
    """The default layout of a buffer of ``size`` read as a view: dim j split
    into ``factors[j]`` (sizes, outer to inner; [] for an unindexed dim),
    starting ``offsets[j]`` elements in.  Same device bytes, no data moved:
    returns (layout of the view, first device element), or raises
    ``Unsupported`` when the view is not one contiguous block of sticks."""
    size = tuple(size) or (1,)
    offsets = list(offsets or [0] * len(size))
    base = SpyreTensorLayout.default(size, dtype)
    n = len(size)
    se = stick_elems(dtype)
    # per host dim: full sizes of its pieces, and (offset, length) of the outer one
    full: list[list[int]] = []
    part: list[tuple[int, int]] = []
    for j, f in enumerate(factors):
        f = list(f) or [1]
        inner = math.prod(f[1:])
        if size[j] % inner or offsets[j] % inner:
            raise Unsupported(f"a reshape of a {list(size)} buffer that does not divide dim {j}")
        full.append([size[j] // inner] + f[1:])
        part.append((offsets[j] // inner, f[0]))
    first, pos = [], 0
    for f in full:
        first.append(pos)
        pos += len(f)
    dev: list[list] = []  # [size, host position, (offset, length) or None]
    last_dev = len(base.device_size) - 1
    for i_dev, (ds, k) in enumerate(zip(base.device_size, base.dim_map)):
        if k < 0:
            dev.append([ds, k, None])
            continue
        f, (o, c) = full[k], part[k]
        partial = (o, c) if (o or c < f[0]) else None
        if i_dev == last_dev:  # the lanes of a stick: the innermost piece of the stick dim
            dev.append([se, first[k] + len(f) - 1, None])
        elif k != n - 1:
            for i, x in enumerate(f):
                dev.append([x, first[k] + i, partial if i == 0 else None])
        elif len(f) > 1:  # the stick blocks of a split stick dim
            if f[-1] % se:
                raise Unsupported(
                    f"a reshape that splits the stick dim of a {list(size)} buffer "
                    f"into pieces of {f[-1]} (not whole sticks of {se})"
                )
            for i, x in enumerate(f[:-1]):
                dev.append([x, first[k] + i, partial if i == 0 else None])
            dev.append([f[-1] // se, first[k] + len(f) - 1, None])
        else:
            if partial and (o % se or (c % se and o + c != size[k])):
                raise Unsupported(
                    f"a slice [{o}:{o + c}] of the stick dim of a {list(size)} buffer "
                    "that is not whole sticks"
                )
            blk = (o // se, -(-c // se)) if partial else None
            dev.append([-(-size[k] // se), first[k], blk])
    # the view must be one contiguous block: one device dim is cut, and every
    # device dim outside it has size 1
    cut = [i for i, d in enumerate(dev) if d[2] is not None]
    if len(cut) > 1 or (cut and any(d[0] != 1 for d in dev[: cut[0]])):
        raise Unsupported(
            f"a slice of a {list(size)} buffer that is not contiguous in device memory"
        )
    start = 0
    if cut:
        p = cut[0]
        o, c = dev[p][2]
        start = o * math.prod(d[0] for d in dev[p + 1 :])
        dev[p] = [c, dev[p][1], None]
    host = []
    for j, f in enumerate(full):
        host.extend([part[j][1]] + f[1:])
    lay = SpyreTensorLayout(tuple(host), tuple(d[0] for d in dev), tuple(d[1] for d in dev), dtype)
    return lay, start


def _stored_layout(buffer: str) -> SpyreTensorLayout | None:
    """The non-default layout a computed intermediate is stored in, if its
    producer chose one (``compiler.layouts``)."""
    from torch_spyre.compiler import layouts

    return layouts.layout_of(buffer)


def strided_view(size, dtype, factors, offsets, ghosts=None):
    """A view that is *not* one contiguous block (a slice of an inner dim:
    the first n positions of every head of a KV cache): the whole buffer as
    the operand, read by a load from per-dim offsets (``Load.offsets``).

    Returns (layout of the whole buffer viewed in ``factors``' pieces, the
    offset along each view host dim).  Raises ``Unsupported`` when the
    offset into the stick dim is not whole sticks (no DMA shifts lanes)."""
    size = tuple(size) or (1,)
    offsets = list(offsets or [0] * len(size))
    se = stick_elems(dtype)
    whole, offs = [], []
    for j, f in enumerate(factors):
        f = list(f) or [1]
        inner = math.prod(f[1:])
        if size[j] % inner:
            raise Unsupported(f"a reshape of a {list(size)} buffer that does not divide dim {j}")
        pieces = [size[j] // inner] + f[1:]
        # the dim's element offset in the pieces' mixed radix; only the outer
        # piece and ghost pieces (ghosts=1-based positions in `ghosts[j]`) start
        # anywhere but 0
        rem, piece_offs = offsets[j], []
        for p in reversed(pieces[1:]):
            rem, o = divmod(rem, p)
            piece_offs.append(o)
        piece_offs = [rem] + piece_offs[::-1]
        free = set(ghosts[j]) if ghosts else set()
        if any(o and i and i not in free for i, o in enumerate(piece_offs)):
            raise Unsupported(
                f"a read of a {list(size)} buffer from element {offsets[j]} of dim {j}"
            )
        if j == len(size) - 1 and piece_offs[-1] % se:
            raise Unsupported(
                f"a slice from element {offsets[j]} of the stick dim of a {list(size)} "
                f"buffer (not whole sticks of {se}: a DMA cannot shift lanes)"
            )
        whole.append(pieces)
        offs.extend(piece_offs)
    lay, start = view_layout(size, dtype, whole)
    assert start == 0
    return lay, tuple(offs)


# ------------------------------------------------------------------ builder
@dataclass
class OperandUse:
    name: str  # program operand name
    buffer: str  # Inductor buffer name (the wrapper variable)
    role: str
    layout: SpyreTensorLayout
    shape: tuple[int, ...]  # the wrapper tensor's shape
    #: first device element of the view (a slice that is one block of sticks)
    start: int = 0
    #: per view host dim, where its loads start (a slice that is not one
    #: block of sticks reads the whole buffer from these offsets)
    load_offsets: tuple[int, ...] = ()


@dataclass
class Plan:
    program: Program
    operands: list[OperandUse]
    removed: set[str] = field(default_factory=set)
    #: a wrapper line to write after the launch (drops a fused matmul's inputs)
    after: str | None = None
    #: kernels to launch first: restickify plans writing an input operand in
    #: the layout this kernel reads it in (``compiler.layouts``)
    pre: list[Plan] = field(default_factory=list)


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


class ProgramBuilder:
    """Records kernel-program steps while Inductor's inner functions run on it."""

    def __init__(
        self, buffer_info, config: HardwareConfig | None = None, simplify=None, naive: bool = False
    ) -> None:
        self._simplify = simplify
        #: plan as a naive backend would (``compiler.options.planning(naive=True)``)
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
        self.load_index: dict[str, tuple[str | None, ...]] = {}
        #: buffers holding an affine function of the loop variables (index_expr)
        self.affine: dict[str, sympy.Expr] = {}
        #: the lane dim of each stick read one element at a time (see _lane)
        self.lane_vars: dict[tuple, str] = {}
        #: 0-dim buffers (their operands are 1-element vectors)
        self.scalars: set[str] = set()
        self._n = 0
        self.node_vars: list[str] = []
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
                    raise Unsupported(f"{name} is read in another shape than it was written")
                for x, y in zip(a, b):
                    self.uf.union(x, y)
            return val
        return self._load_parts(name, factors, offs, size, dtype, share)

    def _load_parts(self, name: str, factors, offs, size, dtype, share: bool = True) -> Val:
        use = self._operand(name, "input", factors, offs, size, dtype)
        idx = self._index(factors)
        key = ("load", use.name) if share else ("load-private", len(self.steps))
        hit = self.cse.get(key)
        if hit is not None:
            # the same operand loaded again (by a later node of the group): reuse
            # the tile already in LX, its dims are this node's dims
            for x, y in zip(self.load_index[use.name], idx):
                if x is not None and y is not None:
                    self.uf.union(x, y)
            return hit
        dims = frozenset(d for d in idx if d is not None)
        buf = self._buf(dims, dtype, double=True)
        self.steps.append(Load(buf, use.name, idx, offsets=use.load_offsets))
        val = Val(buf, dims, dtype)
        self.cse[key] = val
        self.load_index[use.name] = idx
        return val

    def _lane(self, name: str, factors, offs, size, dtype, se: int) -> Val:
        """One element of a stick (``x[..., 3]``: Inductor unrolls reductions
        over fewer than 8 elements into such reads).  A DMA moves whole
        sticks and cannot shift lanes, so the stick is loaded and the lane
        picked on the vector unit: a mask from the lane index, then a
        reduction over the stick with exactly one term kept (exact)."""
        if not (dtype.is_floating_point or dtype == torch.bool):
            raise Unsupported(f"element {offs[-1]} of the stick dim of {name} ({dtype})")
        c0 = offs[-1] - offs[-1] % se
        key = ("lane", name, tuple(tuple(f) for f in factors), tuple(offs[:-1]), c0)
        lane = self.lane_vars.get(key)
        if lane is None:
            lane = self.lane_vars[key] = str(self.new_vars("l", [min(se, size[-1] - c0)])[0])
        block = self._load_parts(name, factors[:-1] + [[lane]], offs[:-1] + [c0], size, dtype)
        sel = self._binary("eq", self._iota(lane), Scal(offs[-1] - c0, torch.float32))
        picked = self._vec("where", [sel, block, self._materialise(Scal(0.0, block.dtype))])
        if dtype == torch.bool:
            return self._reduce("any", picked, [lane], torch.bool)
        return self._reduce("sum", picked, [lane], block.dtype)

    def _load_pieces(self, name: str, dims, size, dtype) -> Val:
        """The whole buffer viewed in pieces, loaded from per-piece offsets."""
        psizes = [p for ps, _, _ in dims for p in ps]
        offs = tuple(o for _, _, os_ in dims for o in os_)
        idx = tuple(v for _, vs, _ in dims for v in vs)
        key = ("pieces", name, tuple(tuple(ps) for ps, _, _ in dims), offs)
        use = self.operands.get(key)
        if use is None:
            lay, start = view_layout(tuple(size), dtype, [ps for ps, _, _ in dims])
            if start or lay.device_numel != _default_numel(size, dtype):
                raise Unsupported(f"a view of {name} in pieces {psizes}")
            shape = () if name in self.scalars else tuple(size)
            use = OperandUse(f"in{len(self.operands)}", name, "input", lay, shape, 0, offs)
            self.operands[key] = use
        ck = ("load", use.name)
        hit = self.cse.get(ck)
        if hit is not None:
            for x, y in zip(self.load_index[use.name], idx):
                if x is not None and y is not None:
                    self.uf.union(x, y)
            return hit
        vdims = frozenset(d for d in idx if d is not None)
        buf = self._buf(vdims, dtype, double=True)
        self.steps.append(Load(buf, use.name, idx, offsets=offs))
        self.cse[ck] = val = Val(buf, vdims, dtype)
        self.load_index[use.name] = idx
        return val

    def _gather(self, name, rest, terms, first, size, stride, offset, dtype, se: int) -> Val:
        """Stick-dim lanes ``first + sum c_v v`` (sub-stick pieces, strided
        patterns; ``compiler/lanes.py``): the whole sticks covering them, then
        a 0/1 table on the PE array.  ``rest`` indexes the other dims.

        Variables whose lane stride is whole sticks and spans everything
        inside (the heads of a fused qkv: 192 h + 16 + i) are blocks of the
        stick dim read through a pieces view, not gathered: the table covers
        one block's lanes only."""
        terms = sorted(terms, key=lambda t: -t[1])
        outer: list[tuple[str, int]] = []
        base = 0
        while len(terms) > 1:
            v, c = terms[0]
            inner_first = first % c
            span = inner_first + sum(ci * (self.ranges[vi] - 1) for vi, ci in terms[1:])
            if c % se or span >= c or size[-1] % c:
                break
            outer.append((v, c))
            base += first - inner_first
            first = inner_first
            terms = terms[1:]
        parts = [(self.ranges[v], c) for v, c in terms]
        last = first + sum(c * (n - 1) for n, c in parts)
        block_lanes = min(c for _, c in outer) if outer else size[-1]
        lo, cover = lanes.covering(block_lanes, last - first + 1, first, se)
        n = math.prod(p for p, _ in parts)
        if cover * n > lanes.MAX_TABLE:
            raise Unsupported(
                f"elements {first}..{last} of the stick dim of {name} {list(size)} in parts "
                f"{parts}: a lane gather of {cover} x {n} is larger than {lanes.MAX_TABLE} "
                f"(not whole sticks of {se})"
            )
        rest = sympy.expand(
            rest + base + sum(sympy.Symbol(v, integer=True, nonnegative=True) * c for v, c in outer)
        )
        j = self.new_vars("j", [cover])[0]
        idx = sympy.expand(rest + offset + lo + j)
        try:
            factors, offs = _decompose(idx, size, stride, offset, self.ranges, f"load of {name}")
            block = self._load_parts(name, factors, offs, size, dtype)
        except Unsupported:
            try:
                dims = pieces.decompose(idx, size, stride, offset, self.ranges, dtype)
            except pieces.PiecesError as e:
                raise Unsupported(f"load of {name}: {e}") from None
            block = self._load_pieces(name, dims, size, dtype)
        # a block this group loaded already carries its own lane variable
        j = next((d for d in block.dims if self.uf.find(d) == self.uf.find(str(j))), str(j))
        key = lanes.table_key(cover, first - lo, parts, dtype)
        use = self.operands.get(("eye", key))
        vs = [v for v, _ in terms]
        if use is None:
            lay = SpyreTensorLayout.default((cover, *(p for p, _ in parts)), dtype)
            shape = (cover, first - lo, *(x for pc in parts for x in pc))
            use = OperandUse(f"ey{len(self.operands)}", key, "eye", lay, shape)
            self.operands[("eye", key)] = use
        buf = self._buf({str(j), *vs}, dtype, double=True)
        self.steps.append(Load(buf, use.name, (str(j), *vs)))
        return self.matmul(block, Val(buf, frozenset({str(j), *vs}), dtype), [str(j)])

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
        if reduction_type in ("sum", "max", "min"):
            return self._reduce(reduction_type, value, rvars, _lx_dtype(dtype))
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
            return Scal(int(expr), dtype)
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
            if op in _PY_BINARY:
                return Scal(_PY_BINARY[op](a.value, b.value), a.dtype)
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
        if name in _BINARY:
            return lambda a, b: self._binary(name, a, b)
        if name.startswith("_"):
            raise AttributeError(name)

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
        prog = _plan_dims(
            name, steps, buffers, ops, sizes, reduced, self.cfg, self.naive,
            streamed=streamed,
        )  # fmt: skip
        plan = Plan(prog, ops, removed)
        if not self.naive and not any(isinstance(s, Matmul) for s in steps):
            # the stick dim of each input operand, chosen by cost (restickify)
            from torch_spyre.compiler import layouts

            def replan(ops2):
                return _plan_dims(
                    name, steps, buffers, ops2, sizes, reduced, self.cfg, self.naive, streamed
                )

            if self.readers_cost is not None:  # computed intermediates: producer's choice
                plan = layouts.choose_output(plan, replan, self.readers_cost, self.cfg)
            plan = layouts.choose(plan, replan, self.buffer_info, self.cfg)
        return plan


def _dkey(d: str) -> int:
    return int(d[1:])


def _rename_step(s, ren: dict[str, str]):
    if isinstance(s, Load | Store):
        return replace(s, index=tuple(ren[d] if d is not None else None for d in s.index))
    if isinstance(s, Reduce):
        return replace(s, dim=ren[s.dim])
    return s


def _reads(s) -> tuple[str, ...]:
    if isinstance(s, Store):
        return (s.buffer,)
    if isinstance(s, Vector):
        return s.inputs
    if isinstance(s, Reduce):
        return (s.input,)
    if isinstance(s, Matmul):
        return (s.a, s.b)
    return ()


def _writes(s) -> str | None:
    if isinstance(s, Load):
        return s.buffer
    if isinstance(s, Vector | Reduce | Matmul):
        return s.out
    return None


def _live(steps):
    """The steps whose results are used (a store, or read by a later live
    step): an index computed only to address a load (``indirect_indexing``
    of an iota) leaves dead vector steps behind, and the multi-pass rewrites
    (``_online_softmax``, ``_one_pass_variance``) leave the steps they
    replaced."""
    needed: set[str] = set()
    out = []
    for s in reversed(steps):
        w = _writes(s)
        if isinstance(s, Store) or w is None or w in needed:
            out.append(s)
            needed.update(_reads(s))
    return out[::-1]


def _reuse_buffers(steps, buffers: dict[str, Buffer]):
    """LX planning inside the kernel: a buffer whose value is dead is reused by
    the next value of the same dims and dtype (vector ops may work in place)."""
    last: dict[str, int] = {}
    for i, s in enumerate(steps):
        for r in _reads(s):
            last[r] = i
    free: dict[tuple, list[str]] = {}
    alias: dict[str, str] = {}
    out_steps = []
    for i, s in enumerate(steps):
        w = _writes(s)
        reads = [alias.get(r, r) for r in _reads(s)]
        if isinstance(s, Store):
            s = replace(s, buffer=reads[0])
        elif isinstance(s, Vector):
            s = replace(s, inputs=tuple(reads))
        elif isinstance(s, Reduce):
            s = replace(s, input=reads[0])
        elif isinstance(s, Matmul):
            s = replace(s, a=reads[0], b=reads[1])
        # release the inputs that die here (before allocating the output: in place)
        if not isinstance(s, Reduce | Matmul):
            _release(s, i, last, alias, buffers, free, steps)
        if w is not None:
            b = buffers[w]
            key = (b.dims, b.dtype, b.double_buffered)
            if not b.double_buffered and free.get(key):
                alias[w] = free[key].pop()
            else:
                alias[w] = w
            if isinstance(s, Load):
                s = replace(s, buffer=alias[w])
            elif isinstance(s, Vector | Reduce | Matmul):
                s = replace(s, out=alias[w])
        if isinstance(s, Reduce | Matmul):
            _release(s, i, last, alias, buffers, free, steps)
        out_steps.append(s)
    used = {x for s in out_steps for x in (*_reads(s), _writes(s)) if x}
    return out_steps, {n: b for n, b in buffers.items() if n in used}


def _release(s, i, last, alias, buffers, free, steps) -> None:
    for orig, at in list(last.items()):
        if at == i:
            phys = alias.get(orig, orig)
            b = buffers[phys]
            if not b.double_buffered:
                free.setdefault((b.dims, b.dtype, b.double_buffered), []).append(phys)
            del last[orig]


def _matmul_split(
    mm, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, mn=None, lx_share: float = 0.5
):
    """Core split, tiles and loops of a kernel built around one PE-array matmul:
    batch dims over cores first, then the output plane over ``mn`` = (pm, pn)
    cores (``n`` in whole sticks; default: ``sim.kernels.default_matmul_split``);
    ``k`` streamed through the LX in tiles (``default_matmul_tiles``).
    None when the shape is not (batch, rows, one n, k)."""
    from torch_spyre.sim.kernels import default_matmul_split, default_matmul_tiles

    a, b, o = (set(buffers[x].dims) for x in (mm.a, mm.b, mm.out))
    kd = sorted((a & b) - o, key=_dkey)
    batch = sorted(a & b & o, key=_dkey)
    rows = sorted((a & o) - b, key=_dkey)
    cols = sorted((b & o) - a, key=_dkey)
    if len(cols) != 1 or not kd:
        return None
    (nd,) = cols
    # dims an epilogue reduces (a softmax over n) stay whole on each core
    held = {s.dim for s in steps if isinstance(s, Reduce)}
    dtype = buffers[mm.a].dtype
    se = stick_elems(dtype)
    m = math.prod(sizes[d] for d in rows) if rows else 1
    n, k = sizes[nd], math.prod(sizes[d] for d in kd)
    split: dict[str, tuple[int, int | None]] = {}
    used = 1
    for d in batch:
        c = max(1, min(sizes[d], cfg.cores // used))
        while (cfg.cores // used) % c:
            c -= 1
        if c > 1:
            split[d] = (c, None)
        used *= c
    rest = cfg.cores // used
    pk = 1
    if mn is not None:
        pm, pn = min(mn[0], rest, m), min(mn[1], max(1, rest // max(mn[0], 1)))
        pk = mn[2] if len(mn) > 2 and len(kd) == 1 else 1
    else:
        pm, pn = default_matmul_split(m, n, k, cfg.replace(cores=rest))[:2] if rest > 1 else (1, 1)
    if nd in held:
        pm, pn = min(rest, m) if mn is None else pm, 1
    row_split = next((d for d in rows if sizes[d] >= pm and d not in held), None)
    if mn is not None and len(mn) > 3:
        # a candidate that splits another row dim (_matmul_choices)
        row_split = rows[mn[3]]
    if row_split is not None and pm > 1:
        split[row_split] = (min(pm, sizes[row_split]), None)
    n_chunk = None
    if pn > 1:
        n_chunk = ceil_div(ceil_div(n, pn), se) * se
        pn = -(-n // n_chunk)
        if pn > 1:
            split[nd] = (pn, n_chunk)
        else:
            n_chunk = None
    em = m
    if row_split is not None and row_split in split:
        em = m // sizes[row_split] * -(-sizes[row_split] // split[row_split][0])
    en = n_chunk or n
    ek = k
    if pk > 1:
        # k over cores in whole sticks: per-core partial sums, combined by a
        # ring all-reduce of each output tile before the epilogue
        ek = ceil_div(ceil_div(k, pk), se) * se
        pk = -(-k // ek)
        if pk > 1:
            split[kd[0]] = (pk, ek)
            at = steps.index(mm) + 1
            steps = [*steps[:at], RingAllReduce(mm.out, kd[0], "sum"), *steps[at:]]
        else:
            ek = k
    # operand and accumulator tiles in ``lx_share`` of the LX (the rest for
    # the epilogue), so ``_fit`` need not shrink the rows
    tm, tn, tk = default_matmul_tiles(
        em, en, ek, dtype, True, cfg.replace(lx_bytes=int(cfg.lx_bytes * lx_share))
    )
    tiles = {d: sizes[d] for d in sizes}
    for d in batch:
        tiles[d] = 1
    if rows:
        r0 = row_split or rows[0]
        i0 = rows.index(r0)
        inner = math.prod(sizes[d] for d in rows[i0 + 1 :])
        for d in rows[:i0]:
            tiles[d] = 1
        tiles[r0] = max(1, tm // max(inner, 1))
        if i0 > 0:
            # an inner row dim split: its core extent caps its tile, and the
            # rest of the row tile goes to the dims outside it (otherwise each
            # weight tile would serve one element of the outer dims at a time)
            ext = -(-sizes[r0] // split[r0][0]) if r0 in split else sizes[r0]
            tiles[r0] = min(tiles[r0], ext)
            left = tm // max(inner * tiles[r0], 1)
            for d in reversed(rows[:i0]):
                if left < 2:
                    break
                tiles[d] = min(sizes[d], left)
                left //= tiles[d]
    tiles[nd] = sizes[nd] if nd in held else tn
    inner_k = kd[-1]
    tiles[inner_k] = min(sizes[inner_k] if pk == 1 else ek, tk)
    for d in kd[:-1]:
        tiles[d] = 1 if tk < sizes[inner_k] else max(1, tk // sizes[inner_k])
    others = [d for d in sorted(sizes, key=_dkey) if d not in (*batch, *rows, nd, *kd)]
    loops = tuple(batch + rows + [nd] + [d for d in others if d not in reduced] + kd)
    steps = _prologue_first(steps, mm, set(kd), buffers)
    mm_bufs = {mm.a, mm.b}
    kset = set(kd)
    mm_steps = {
        i
        for i, s in enumerate(steps)
        if s is mm
        or (isinstance(s, Load) and s.buffer in mm_bufs)
        # a weight's prologue (its dequantisation): whatever works on k tiles
        or (isinstance(s, Load | Vector) and kset & set(buffers[step_writes(s)].dims))
    }
    return split, tiles, loops, mm_steps, steps


def _prologue_first(steps, mm, kd: set[str], buffers):
    """Steps before the matmul that do not work on k tiles (a weight scale's
    load) moved ahead of those that do, so the k loop is one loop."""
    at = steps.index(mm)
    before = steps[:at]

    def on_k(s) -> bool:
        w = step_writes(s)
        return w is not None and bool(kd & set(buffers[w].dims))

    outer = [s for s in before if not on_k(s)]
    if not outer or len(outer) == len(before):
        return steps
    k_written = {step_writes(s) for s in before if s not in outer}
    if any(r in k_written for s in outer for r in step_reads(s)):
        return steps  # an outer step reads a k tile: keep the program order
    inner = [s for s in before if s not in outer]
    return [*outer, *inner, *steps[at:]]


def _stream_rows(steps, buffers, reduced) -> set[int] | None:
    """The steps that work on row data (buffers with a reduced dim) when the
    rows can be streamed: no row step uses a reduction's result (softmax and
    layer norm need the whole row twice).  None when they cannot."""
    derived: set[str] = set()
    partial: set[str] = set()
    row: set[int] = set()
    for i, s in enumerate(steps):
        touched = [*_reads(s), *([_writes(s)] if _writes(s) else [])]
        on_row = any(set(buffers[b].dims) & reduced for b in touched) or (
            isinstance(s, Load | Store) and set(s.index) & reduced
        )
        if on_row:
            # a reduction of a partial reduction (several reduced dims) may stream
            if any(
                r in derived and not (isinstance(s, Reduce) and r in partial) for r in _reads(s)
            ):
                return None
            row.add(i)
        if isinstance(s, Reduce) or any(r in derived for r in _reads(s)):
            if _writes(s):
                derived.add(_writes(s))
                if isinstance(s, Reduce) and set(buffers[s.out].dims) & reduced:
                    partial.add(s.out)
    return row


def _readers(steps) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for r in _reads(s):
            out.setdefault(r, []).append(i)
    return out


def _producers(steps, buffers, reduced):
    """For matching patterns in a group's steps: (step index by the buffer it
    writes, whether a buffer holds row values, the producer of a buffer if it
    is a ``cls`` step with op ``op``)."""
    prod = {_writes(s): i for i, s in enumerate(steps) if _writes(s)}

    def row(b):
        return bool(set(buffers[b].dims) & reduced)

    def step(b, cls, op=None):
        st = steps[prod[b]] if b in prod else None
        return st if isinstance(st, cls) and (op is None or st.op == op) else None

    return prod, row, step


def _online_softmax(steps, buffers, reduced):
    """Softmax's max and sum in one pass over the row: ``m = max(x)``,
    ``s = sum(exp(x - m))`` become ``m = logsumexp(x)`` (an online max and
    sum, rescaled per tile) and ``s = 1``, so ``exp(x - m) / s`` and
    ``x - m - log(s)`` (log-softmax) keep their values while the row is read
    twice instead of three times.  Only when every reader of m, s, x - m and
    exp(x - m) is one of those expressions."""
    steps, buffers = list(steps), dict(buffers)
    prod, row, step = _producers(steps, buffers, reduced)

    for i, s in enumerate(list(steps)):
        if not (isinstance(s, Reduce) and s.op == "sum" and row(s.input) and not row(s.out)):
            continue
        pe = step(s.input, Vector, "exp")
        pd = pe and step(pe.inputs[0], Vector, "sub")
        pm = pd and step(pd.inputs[1], Reduce, "max")
        if not (pm and pm.dim == s.dim and pm.input == pd.inputs[0] and not row(pm.out)):
            continue
        rd = _readers(steps)
        e, d, m, tot = s.input, pd.out, pm.out, s.out
        ok = rd.get(m) == [prod[d]]
        for j in rd.get(tot, []):
            t = steps[j]
            if isinstance(t, Vector) and t.op == "reciprocal":
                ok &= all(
                    isinstance(steps[k], Vector) and steps[k].op == "mul" and e in steps[k].inputs
                    for k in rd.get(t.out, [])
                )
            elif isinstance(t, Vector) and t.op == "log":
                ok &= all(
                    isinstance(steps[k], Vector) and steps[k].op == "sub"
                    and steps[k].inputs == (d, t.out)
                    for k in rd.get(t.out, [])
                )  # fmt: skip
            elif isinstance(t, Vector) and t.op == "div":
                ok &= t.inputs == (e, tot)
            else:
                ok = False
        for j in rd.get(e, []):
            t = steps[j]
            ok &= j == i or (isinstance(t, Vector) and t.op in ("mul", "div"))
        for j in rd.get(d, []):
            t = steps[j]
            ok &= j == prod[e] or (isinstance(t, Vector) and t.op == "sub" and t.inputs[0] == d)
        if not ok:
            continue
        one = f"{tot}_0"
        buffers[one] = replace(buffers[tot], name=one, double_buffered=False)
        steps[prod[m]] = Reduce("logsumexp", m, pm.input, pm.dim)
        steps[i] = [
            Vector("mul_scalar", one, (m,), (0.0,)),
            Vector("add_scalar", tot, (one,), (1.0,)),
        ]
        steps = [x for st in steps for x in (st if isinstance(st, list) else [st])]
        prod, row, step = _producers(steps, buffers, reduced)
    return steps, buffers


def _one_pass_variance(steps, buffers, reduced):
    """A norm's ``m2 = sum((x - sum(x) / n)^2)`` (two passes over the row) as
    ``sum(x^2) - sum(x) * mean`` (clamped at 0), summed in the same pass as
    ``sum(x)``: a layer norm reads its row twice (statistics, normalise)."""
    steps, buffers = list(steps), dict(buffers)
    prod, row, step = _producers(steps, buffers, reduced)

    for i, s in enumerate(list(steps)):
        if not (isinstance(s, Reduce) and s.op == "sum" and row(s.input) and not row(s.out)):
            continue
        psq = step(s.input, Vector, "square")
        pxc = psq and step(psq.inputs[0], Vector, "sub")
        pmean = pxc and step(pxc.inputs[1], Vector, "mul_scalar")
        ps = pmean and step(pmean.inputs[0], Reduce, "sum")
        if not (ps and ps.dim == s.dim and ps.input == pxc.inputs[0] and not row(ps.out)):
            continue
        x, mean, tot, m2 = ps.input, pmean.out, ps.out, s.out
        new = {f"{m2}_{k}": b for k, b in (("x2", x), ("q", m2), ("t", m2), ("r", m2))}
        for n, like in new.items():
            buffers[n] = replace(buffers[like], name=n, dtype=torch.float32, double_buffered=False)
        x2, q, t, r = new
        steps[i] = [
            Vector("square", x2, (x,)),
            Reduce("sum", q, x2, s.dim),
            Vector("mul", t, (tot, mean)),
            Vector("sub", r, (q, t)),
            Vector("maximum_scalar", m2, (r,), (0.0,)),
        ]
        steps = [x for st in steps for x in (st if isinstance(st, list) else [st])]
        prod, row, step = _producers(steps, buffers, reduced)
    return steps, buffers


@functools.lru_cache(maxsize=256)
def _multipass(steps, buffer_items, reduced: frozenset):
    """A fused row kernel whose rows do not fit the LX and whose row steps
    use a reduction's result (softmax, layer / RMS norm) as several passes
    over the row, each walking the row in tiles and re-reading it from
    device memory: pass p computes the reductions that depend on p earlier
    ones (recomputing the row values it needs from the loads), the per-row
    results are combined between passes.  Softmax's max and sum share one
    pass (``_online_softmax``), as do a norm's sum and sum of squares
    (``_one_pass_variance``), so softmax and norms read their row twice.

    ``steps`` are the group's steps before LX reuse (every buffer written
    once).  Returns (steps, buffers, indices of the row steps) or None."""
    steps, buffers = list(steps), dict(buffer_items)
    writes = [_writes(s) for s in steps if _writes(s)]
    if len(writes) != len(set(writes)) or any(isinstance(s, Matmul) for s in steps):
        return None
    steps, buffers = _online_softmax(steps, buffers, reduced)
    steps, buffers = _one_pass_variance(steps, buffers, reduced)
    steps = _live(steps)

    def is_row(s) -> bool:
        touched = [*_reads(s), *([_writes(s)] if _writes(s) else [])]
        return any(set(buffers[b].dims) & reduced for b in touched) or (
            isinstance(s, Load | Store) and bool(set(s.index) & reduced)
        )

    def is_row_buf(b) -> bool:
        return bool(set(buffers[b].dims) & reduced)

    prod = {_writes(s): i for i, s in enumerate(steps) if _writes(s)}
    level: dict[str, int] = {}
    where: list[int] = []  # the pass (or the section before it) of each step
    for s in steps:
        lv = max((level[r] for r in _reads(s)), default=0)
        where.append(lv)
        w = _writes(s)
        if w is not None:
            ends = isinstance(s, Reduce) and not set(buffers[w].dims) & reduced
            level[w] = lv + 1 if ends and is_row(s) else lv
    row = [is_row(s) for s in steps]
    passes = max((where[i] for i in range(len(steps)) if row[i]), default=0)
    if passes == 0:
        return None  # one pass: ``_stream_rows`` handles it
    out: list = []
    out_row: list[int] = []
    for p in range(max(where) + 1):
        out.extend(s for i, s in enumerate(steps) if not row[i] and where[i] == p)
        # seeds: the reductions that end in this pass and its stores; the
        # row steps they read join it (recomputed if an earlier pass had them)
        need = {
            i
            for i, s in enumerate(steps)
            if row[i] and where[i] == p
            and (isinstance(s, Store) or (isinstance(s, Reduce) and not is_row_buf(s.out)))
        }  # fmt: skip
        todo = list(need)
        while todo:  # recompute the row values this pass reads
            for r in _reads(steps[todo.pop()]):
                j = prod[r]
                if row[j] and is_row_buf(r) and j not in need:
                    need.add(j)
                    todo.append(j)
        for i in sorted(need):
            out_row.append(len(out))
            out.append(steps[i])
    steps, buffers = _reuse_buffers(out, buffers)
    for st in steps:
        if isinstance(st, Store) and not buffers[st.buffer].double_buffered:
            buffers[st.buffer] = replace(buffers[st.buffer], double_buffered=True)
    return steps, buffers, set(out_row)


#: plans by kernel structure: a model's layers repeat the same kernels, and
#: the cost-model search over splits and tiles is the bulk of compile time
_PLANS: dict[tuple, Program | Unsupported] = {}


def _plan_dims(
    name, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, naive: bool = False,
    streamed=None,
) -> Program:  # fmt: skip
    """``_search_plan``, memoised on everything it reads (the name aside)."""
    key = (
        tuple(steps),
        tuple(buffers.items()),
        tuple((u.name, u.role, u.layout) for u in ops),
        tuple(sorted(sizes.items())),
        frozenset(reduced),
        cfg,
        naive,
        streamed,
    )
    hit = _PLANS.get(key)
    if hit is None:
        try:
            hit = _search_plan(name, steps, buffers, ops, sizes, reduced, cfg, naive, streamed)
        except Unsupported as e:
            hit = e
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = hit
    if isinstance(hit, Unsupported):
        raise Unsupported(str(hit))
    return hit if hit.name == name else replace(hit, name=name)


def _search_plan(
    name, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, naive: bool = False,
    streamed=None,
) -> Program:  # fmt: skip
    """Core split and tiles for the fused kernel, checked against the LX.

    A matmul kernel's split (and whether shared tiles are multicast), and a
    row kernel's tile, are chosen by the timing model among candidates;
    ``naive`` plans rows over cores with no operand reuse (for baselines)."""
    names = sorted(sizes, key=_dkey)
    loops = tuple(n for n in names if n not in reduced)
    # stick dims of stored operands: split over cores in whole sticks
    stick_of: dict[str, int] = {}
    for s in steps:
        if isinstance(s, Store | Load):
            lay = next(u.layout for u in ops if u.name == s.operand)
            d = s.index[lay.stick_dim] if lay.host_size else None
            if d is not None:
                stick_of[d] = max(stick_of.get(d, 1), stick_elems(lay.dtype))
    split: dict[str, tuple[int, int | None]] = {}
    remaining = cfg.cores
    cand = []
    for d in loops:
        se = stick_of.get(d)
        work = -(-sizes[d] // se) if se else sizes[d]
        cand.append((-work, se is not None, d))
    for _, _, d in sorted(cand):
        if remaining < 2:
            break
        se = stick_of.get(d)
        if se:
            sticks = -(-sizes[d] // se)
            n = min(remaining, sticks)
            if n < 2:
                continue
            chunk = -(-sticks // n) * se
            n = -(-sizes[d] // chunk)
            split[d] = (n, chunk if n > 1 else None)
        else:
            n = min(remaining, sizes[d])
            if n < 2:
                continue
            split[d] = (n, None)
        remaining //= n
    ext = {
        d: (split[d][1] or -(-sizes[d] // split[d][0])) if d in split else sizes[d] for d in names
    }
    tiles = {d: ext[d] for d in names}
    mm = next((s for s in steps if isinstance(s, Matmul)), None)
    # candidates: (split, tiles, loops, steps in the innermost loop, multicast)
    cands: list[tuple] = [(split, tiles, loops, set(), steps, False)]
    if mm is not None:
        mm_cands = []
        for mn, mc in _matmul_choices(mm, steps, buffers, sizes, cfg, naive):
            # tiles filling the whole LX (fewer operand re-reads) or half of it
            # (room for a large epilogue); naive: half
            for share in (0.5,) if naive else (1.0, 0.5):
                planned = _matmul_split(mm, steps, buffers, ops, sizes, reduced, cfg, mn, share)
                if planned is None:
                    break
                mm_cands.append((*planned, mc))
        cands = mm_cands or cands
    elif not naive:
        cands += _pipelined_tiles(split, tiles, loops, steps, reduced, stick_of)
    best: tuple[float, Program] | None = None
    error: ProgramError | None = None
    for split_, tiles_, loops_, mm_steps, steps_, mc in cands:
        try:
            prog = _fit(
                name, steps_, buffers, ops, sizes, reduced, cfg, names, stick_of,
                split_, dict(tiles_), loops_, mm_steps, mc, mm is not None, streamed,
            )  # fmt: skip
        except ProgramError as e:
            error = error or e
            continue
        if len(cands) == 1 or naive:  # naive: the first plan that fits
            return prog
        # the cost model decides among the candidates (closed form, ~1 ms each)
        t = estimate(prog, cfg).time_s
        if best is None or t < best[0]:
            best = (t, prog)
    if best is None:
        raise Unsupported(str(error)) from None
    return best[1]


def _matmul_choices(mm, steps, buffers, sizes, cfg: HardwareConfig, naive: bool):
    """(pm, pn, pk) core splits of a matmul's rows, columns and contraction, and
    whether tiles shared by a group of cores are read once and multicast over
    the ring.

    Naive: rows over the cores, no operand reuse.  Otherwise every split of
    the cores left after the batch dims (powers of two, fewer cores included:
    a small matmul loses more to replicated operand traffic than it gains; k
    split over cores adds a ring all-reduce of each output tile), with and
    without multicast; the cost model picks (``_plan_dims``)."""
    a, b, o = (set(buffers[x].dims) for x in (mm.a, mm.b, mm.out))
    batch = sorted(a & b & o, key=_dkey)
    rows = sorted((a & o) - b, key=_dkey)
    cols = sorted((b & o) - a, key=_dkey)
    m = math.prod(sizes[d] for d in rows) if rows else 1
    used = 1
    for d in batch:
        c = max(1, min(sizes[d], cfg.cores // used))
        while (cfg.cores // used) % c:
            c -= 1
        used *= c
    rest = cfg.cores // used
    if naive:
        # a core's 256 MiB address span may not cover a whole weight (a
        # vocabulary projection's [N, K], K the stick dim): then k over the
        # fewest cores whose share fits
        pm = min(rest, m)
        return [((pm, 1, 1 << i), False) for i in range(max(1, rest // pm).bit_length())]
    if len(cols) != 1:
        return [(None, True)]
    held = cols[0] in {s.dim for s in steps if isinstance(s, Reduce)}
    se = stick_elems(buffers[mm.a].dtype)
    n_sticks = ceil_div(sizes[cols[0]], se)
    kd = sorted((a & b) - o, key=_dkey)
    k_sticks = ceil_div(sizes[kd[0]], se) if len(kd) == 1 else 1
    pows = [1 << i for i in range(rest.bit_length()) if 1 << i <= rest]
    out = []
    for pm in pows:
        for pn in pows:
            for pk in pows:
                if pm * pn * pk > rest or pm > m or pn > n_sticks or (held and pn > 1):
                    continue
                if pk > k_sticks:
                    continue
                out += [((pm, pn, pk), True), ((pm, pn, pk), False)]
                # rows in several dims (a [B, S, K] activation): the outer one
                # is split when it can take the cores; the inner one is
                # outermost in device memory ([S, K/64, B, 64]), so splitting
                # it is what keeps a large activation and output inside a
                # core's span: a candidate too
                for i, d in enumerate(rows[1:], 1):
                    if pm > 1 and sizes[d] >= pm:
                        out += [((pm, pn, pk, i), True), ((pm, pn, pk, i), False)]
    return out or [(None, True)]


def _pipelined_tiles(split, tiles, loops, steps, reduced, stick_of):
    """Smaller tiles of the outermost loop dim, so each core walks several
    tiles and its loads, compute and stores overlap (a single tile per core
    runs them one after another); the cost model picks (``_plan_dims``)."""
    outer = [d for d in loops if d not in reduced]
    if not outer:
        return []
    d = outer[0]
    if stick_of.get(d):
        return []
    out = []
    t = tiles[d]
    while t > 1 and len(out) < 5:
        t = ceil_div(t, 2)
        out.append((split, {**tiles, d: t}, loops, set(), steps, False))
    return out


def _lx_total(prog: Program, cfg: HardwareConfig) -> int:
    """``sum(prog.lx_usage(cfg).values())`` in one pass over the steps (the
    tile search asks it for every shrink of every candidate)."""
    dims = {d.name: d for d in prog.dims}
    ext = {b.name: dict.fromkeys(b.dims, 1) for b in prog.buffers}
    for s in prog.steps:
        w = step_writes(s)
        for name in (*step_reads(s), *((w,) if w else ())):
            e = ext.get(name)
            if e is None:
                continue
            for d in e:
                x = dims[d].tile_size if d in s.loops else dims[d].core_extent
                if x > e[d]:
                    e[d] = x
    total = 0
    for b in prog.buffers:
        itemsize = _ITEMSIZE.get(b.dtype) or torch.empty((), dtype=b.dtype).element_size()
        _ITEMSIZE[b.dtype] = itemsize
        stick = cfg.stick_bytes // itemsize
        ex = [ext[b.name][d] for d in b.dims] or [1]
        ex[-1] = ceil_div(ex[-1], stick) * stick
        total += math.prod(ex) * itemsize * (2 if b.double_buffered else 1)
    return total


_ITEMSIZE: dict[torch.dtype, int] = {}


def _fit(
    name, steps, buffers, ops, sizes, reduced, cfg, names, stick_of,
    split, tiles, loops, mm_steps, multicast: bool, has_mm: bool, streamed=None,
) -> Program:  # fmt: skip
    """The program of one split: tiles shrunk until the working set fits half
    the LX (rows streamed when they cannot: in one pass when no row step uses
    a reduction's result, else in several passes over the row, ``_multipass``),
    validated."""

    def build() -> Program:
        dims = tuple(
            Dim(
                d,
                sizes[d],
                *(split.get(d, (1, None))[:1]),
                tile=tiles[d] if d in loops else None,
                chunk=split.get(d, (1, None))[1],
            )
            for d in names
        )
        st = []
        # the k loop of a matmul is innermost: only its loads and the PE-array
        # step are inside it, the epilogue runs once per output tile
        outer = tuple(d for d in loops if d not in reduced)
        for i, s in enumerate(steps):
            lp = loops if i in mm_steps else outer
            if isinstance(s, Load):
                used = [d for d in s.index if d is not None]
                last = max((lp.index(d) for d in used if d in lp), default=-1)
                # a tile shared by a group of cores: read once, all-gathered
                shared = math.prod(split[d][0] for d in split if d not in used)
                st.append(replace(s, loops=lp[: last + 1], multicast=multicast and shared > 1))
            else:
                st.append(replace(s, loops=lp))
        st = _hoist_short_loads(st)
        return Program(
            name=name,
            dims=dims,
            operands=tuple(
                Operand(u.name, u.layout, "input" if u.role in lanes.CONST_ROLES else u.role)
                for u in ops
            ),
            buffers=tuple(buffers.values()),
            steps=tuple(st),
            loop_order=loops,
        )

    # a matmul kernel is the whole program on its cores: it may use all of
    # the LX; other kernels leave half as headroom
    budget = cfg.lx_bytes if has_mm else cfg.lx_bytes // 2
    prog = build()
    while _lx_total(prog, cfg) > budget:
        shrunk = False
        for d in loops:  # outermost first: rows before sticks
            if d in reduced:
                continue
            se = stick_of.get(d)
            if se and d == loops[-1]:
                if tiles[d] > se:
                    tiles[d] = max(se, (tiles[d] // 2) // se * se)
                    shrunk = True
                    break
            elif tiles[d] > 1:
                tiles[d] = max(1, tiles[d] // 2)
                shrunk = True
                break
        if not shrunk:
            break
        prog = build()
    if _lx_total(prog, cfg) > budget and not has_mm and reduced:
        row_steps = _stream_rows(steps, buffers, reduced)
        multi = None
        # several passes only when the rows do not fit the LX at all (a plan
        # over the half-LX budget that fits is kept, as before)
        if row_steps is None and streamed is not None and _lx_total(prog, cfg) > cfg.lx_bytes:
            # a row used after its reduction (softmax, norms): several passes
            multi = _multipass(*streamed, frozenset(reduced))
            if multi is not None:
                steps, buffers, row_steps = multi
        if row_steps is not None:
            # rows longer than the LX: walk the reduced dims in tiles too; a
            # Reduce over a looped dim accumulates over the tiles
            mm_steps = row_steps
            loops = (
                tuple(d for d in loops if d not in reduced)
                + tuple(d for d in names if d in reduced)[:1]
            )
            for d in reversed(loops):
                if d not in reduced:
                    break
                se = stick_of.get(d, 1)
                while _lx_total(build(), cfg) > budget and tiles[d] > se:
                    tiles[d] = max(se, (tiles[d] // 2) // se * se)
            prog = build()
            if multi is not None:
                prog = _balance_row_tiles(prog, build, tiles, loops, reduced, stick_of, cfg, budget)
    prog.validate(cfg)
    return prog


def _hoist_short_loads(steps: list) -> list:
    """An input loaded in fewer loops than the steps after it (an epilogue's
    per-row scale, [M, 1], read outside the column loop) is loaded before the
    first step that opens those loops, so the loop nest stays one nest (a
    load between two steps of a loop would close it and open a second one)."""
    out = list(steps)
    i = 0
    while i < len(out):
        s = out[i]
        if isinstance(s, Load) and i > 0:
            n = len(s.loops)
            prev = out[i - 1].loops
            later = any(len(t.loops) > n and t.loops[:n] == s.loops for t in out[i + 1 :])
            if len(prev) > n and prev[:n] == s.loops and later:
                # the first step of the run of deeper steps just before it
                j = i - 1
                while j > 0 and len(out[j - 1].loops) > n and out[j - 1].loops[:n] == s.loops:
                    j -= 1
                out.insert(j, out.pop(i))
        i += 1
    return out


def _balance_row_tiles(prog, build, tiles, loops, reduced, stick_of, cfg, budget) -> Program:
    """Rows streamed in several passes: more rows per tile and shorter row
    tiles move the same row bytes but re-read operands as long as a row (a
    norm's weight) fewer times; the cost model picks among the splits of the
    same LX budget that fit."""
    rows = [d for d in loops if d not in reduced]
    red = [d for d in loops if d in reduced]
    if not rows or not red:
        return prog
    ro, rd = rows[-1], red[0]
    se = stick_of.get(rd, 1)
    base = dict(tiles)
    best = (estimate(prog, cfg).time_s, prog, dict(tiles))
    f = 2
    while base[rd] // f >= se:
        tiles.update(base)
        tiles[ro] = base[ro] * f
        tiles[rd] = max(se, base[rd] // f // se * se)
        cand = build()
        if tiles[ro] <= cand.dim(ro).core_extent and _lx_total(cand, cfg) <= budget:
            t = estimate(cand, cfg).time_s
            if t < best[0]:
                best = (t, cand, dict(tiles))
        f *= 2
    tiles.update(best[2])
    return best[1]
