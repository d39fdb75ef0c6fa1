"""The kernel program: one serialisable SPMD dataflow kernel.

Every producer (eager ops, the compiler) emits one of these; the simulated
card validates, executes and times it.  The model:

* an **iteration space** of named dims (``Dim``), each split evenly over
  ``cores`` cores (the core grid is the product of the splits, row-major in
  dim order) and walked by each core in tiles of ``tile`` elements;
* **operands**: device tensors (inputs / outputs) with their stick layouts;
* **LX buffers**: named scratchpad tensors indexed by iteration dims, single
  or double buffered; their size per core follows from the tiles;
* **steps**, in program order, each nested in a prefix ``loops`` of the tile
  loop order: stick-granular ``Load``/``Store`` between an operand and a
  buffer (``index`` names the iteration dim of each host dim), PE-array
  ``Matmul``, vector-unit ``Vector`` (elementwise, by op name) and
  ``Reduce`` (along one dim), and ``RingAllReduce`` across the cores that
  split a dim.

A step inside a loop over dim d sees one tile of d; otherwise it sees the
core's whole range of d.  A contraction (Matmul, Reduce) over a looped dim
accumulates over the tiles (from the second tile on it adds into the
buffer's current value, so a ``Vector`` step between two tiles acts on the
running result: the rescaling of an online softmax); over a dim split across
cores it leaves one
partial result per core, which a ``RingAllReduce`` over that dim combines
(storing a partial result is an error).  A ``Store`` of a buffer that lacks
some dims split over cores is done by the cores at grid coordinate 0 of
those dims (the others hold replicas).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torch_spyre.layout import SpyreTensorLayout, ceil_div
from torch_spyre.sim import ops as ops_mod
from torch_spyre.sim.config import HardwareConfig


class ProgramError(ValueError):
    """A kernel program that cannot run on the configured card."""


class LXOverflowError(ProgramError):
    pass


class SpanError(ProgramError):
    pass


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ pieces
@dataclass(frozen=True)
class Dim:
    name: str
    size: int
    #: cores this dim is split over (1: every core sees all of it)
    cores: int = 1
    #: elements per tile loop step on one core (None: the core's whole range)
    tile: int | None = None
    #: elements per core (None: ceil(size / cores)); e.g. whole sticks
    chunk: int | None = None
    #: causal structure (attention): position j of this dim is used only with
    #: positions i >= j of dim ``causal_to``, so an instance of a step inside
    #: the loops of both dims whose tile of this dim starts after the last
    #: position of the tile of ``causal_to`` is skipped (the timing model
    #: counts only the instances that run).  The program must itself mask the
    #: positions j > i of the tiles it does run; skipped tiles would contribute
    #: nothing, so the functional executor runs the whole space.
    causal_to: str | None = None

    @property
    def core_extent(self) -> int:
        """Elements of this dim on the fullest core (core c starts at c * this)."""
        return self.chunk or ceil_div(self.size, self.cores)

    @property
    def tile_size(self) -> int:
        return min(self.tile or self.core_extent, self.core_extent)

    def extent_on(self, coord: int) -> int:
        """Elements of this dim on the core at grid coordinate ``coord``."""
        return max(0, min(self.size - coord * self.core_extent, self.core_extent))


@dataclass(frozen=True)
class Operand:
    name: str
    layout: SpyreTensorLayout
    role: Literal["input", "output", "inout"] = "input"


@dataclass(frozen=True)
class Buffer:
    """An LX scratchpad buffer indexed by iteration dims (outer to inner)."""

    name: str
    dims: tuple[str, ...]
    dtype: torch.dtype = torch.float16
    #: two copies so the DMA engine fills one while compute uses the other
    double_buffered: bool = False


@dataclass(frozen=True)
class Load:
    buffer: str
    operand: str
    #: iteration dim of each host dim of the operand (None: a size-1 dim)
    index: tuple[str | None, ...]
    loops: tuple[str, ...] = ()
    #: the cores that split dims this load does not index need the same
    #: tile: each reads 1/group of it from device memory and the ring
    #: all-gathers the rest (less LPDDR5 traffic, more ring traffic)
    multicast: bool = False
    #: first element read along each host dim of the operand (() = all 0):
    #: the load reads a sub-block (a slice that is not one contiguous run of
    #: sticks, e.g. the first n positions of every head of a KV cache); a dim
    #: indexed by None then reads the one element at its offset.  The stick
    #: dim's offset is whole sticks: the DMA engine moves sticks, it does not
    #: shift lanes.
    offsets: tuple[int, ...] = ()
    #: paged reads (a KV cache): host dim ``rows_dim`` of the operand is
    #: addressed through the row numbers held in LX buffer ``rows`` (int32,
    #: indexed by its own dims, the last of which is ``index[rows_dim]``);
    #: the DMA engine issues one descriptor per ``rows_run`` consecutive rows
    #: (a page).  A negative row number reads row 0 (padding, masked later).
    rows: str | None = None
    rows_dim: int = 0
    rows_run: int = 1
    kind: Literal["load"] = "load"


@dataclass(frozen=True)
class Store:
    operand: str
    buffer: str
    index: tuple[str | None, ...]
    loops: tuple[str, ...] = ()
    #: first element written along each host dim (() = all 0): the store
    #: writes a sub-block of the operand (as ``Load.offsets``; the stick
    #: dim's offset is whole sticks), e.g. one expert's rows of a grouped
    #: output
    offsets: tuple[int, ...] = ()
    #: scattered writes: as ``Load.rows``; a negative row number is not
    #: written (a padded query row)
    rows: str | None = None
    rows_dim: int = 0
    rows_run: int = 1
    kind: Literal["store"] = "store"


@dataclass(frozen=True)
class Matmul:
    """``out[...] = sum_k a[..k..] * b[..k..]`` on the PE array, fp32 accumulation.

    The contracted dims are those of ``a`` and ``b`` that ``out`` lacks.
    """

    out: str
    a: str
    b: str
    loops: tuple[str, ...] = ()
    kind: Literal["matmul"] = "matmul"


@dataclass(frozen=True)
class Vector:
    """Elementwise op on the vector units; inputs broadcast by dim name."""

    op: str
    out: str
    inputs: tuple[str, ...]
    scalars: tuple[float, ...] = ()
    loops: tuple[str, ...] = ()
    kind: Literal["vector"] = "vector"


@dataclass(frozen=True)
class Reduce:
    """``out = op over dim of input`` on the vector units (fp32 accumulation)."""

    op: str
    out: str
    input: str
    dim: str
    loops: tuple[str, ...] = ()
    kind: Literal["reduce"] = "reduce"


@dataclass(frozen=True)
class Scan:
    """A sequential scan along ``dim`` on the vector units (fp32):

    * ``cumsum``: ``out[i] = out[i-1] + x[i]`` (inputs ``(x,)``);
    * ``linrec``: ``out[i] = a[i] * out[i-1] + u[i]`` (inputs ``(a, u)`` or
      ``(a, u, init)``; ``out[-1] = init``, a buffer without ``dim``, else 0):
      the state passing of a state-space model.

    Element i needs element i-1: the scanned dim is walked one element after
    another (never split over cores, never packed into vector lanes), the
    other dims of the output are the vector work of each element.  Inside a
    loop over ``dim`` the scan carries its state from one tile to the next.
    """

    op: str
    out: str
    inputs: tuple[str, ...]
    dim: str
    loops: tuple[str, ...] = ()
    kind: Literal["scan"] = "scan"


#: the scans the IR knows, with the number of buffer inputs (with / without an init)
SCANS: dict[str, tuple[int, ...]] = {"cumsum": (1,), "linrec": (2, 3)}


@dataclass(frozen=True)
class RingAllReduce:
    """Combine the per-core partials of ``buffer`` over the cores splitting ``dim``."""

    buffer: str
    dim: str
    op: str = "sum"
    loops: tuple[str, ...] = ()
    kind: Literal["allreduce"] = "allreduce"


Step = Load | Store | Matmul | Vector | Reduce | Scan | RingAllReduce
_STEP_TYPES: dict[str, type] = {
    "load": Load,
    "store": Store,
    "matmul": Matmul,
    "vector": Vector,
    "reduce": Reduce,
    "scan": Scan,
    "allreduce": RingAllReduce,
}


def step_reads(s: Step) -> tuple[str, ...]:
    if isinstance(s, Load):
        return (s.rows,) if s.rows else ()
    if isinstance(s, Store):
        return (s.buffer, s.rows) if s.rows else (s.buffer,)
    if isinstance(s, Matmul):
        return (s.a, s.b)
    if isinstance(s, Vector | Scan):
        return s.inputs
    if isinstance(s, Reduce):
        return (s.input,)
    if isinstance(s, RingAllReduce):
        return (s.buffer,)
    return ()


def transfer_dims(p: Program, s: Load | Store) -> tuple[str, ...]:
    """The iteration dims a load/store covers: its index's, and for a paged
    transfer those of its row table (a request's pages: ``b`` then ``kv``)."""
    idx = tuple(d for d in s.index if d is not None)
    if not s.rows:
        return idx
    table = p.buffer(s.rows).dims
    return table + tuple(d for d in idx if d not in table)


def step_writes(s: Step) -> str | None:
    if isinstance(s, Load):
        return s.buffer
    if isinstance(s, Matmul | Vector | Reduce | Scan):
        return s.out
    if isinstance(s, RingAllReduce):
        return s.buffer
    return None


def sole_load(steps: Sequence[Step], m: int, name: str) -> int | None:
    """The index of the Load (not a paged one) that last wrote buffer ``name``
    before step ``m``, when ``m`` is its only reader until the buffer is
    rewritten; else None."""
    w = next((i for i in range(m - 1, -1, -1) if step_writes(steps[i]) == name), None)
    if w is None or not isinstance(steps[w], Load) or steps[w].rows:
        return None
    end = next((i for i in range(w + 1, len(steps)) if step_writes(steps[i]) == name), len(steps))
    if [i for i in range(w + 1, end) if name in step_reads(steps[i])] != [m]:
        return None
    return w


# ----------------------------------------------------------------- program
@dataclass(frozen=True)
class Program:
    name: str
    dims: tuple[Dim, ...]
    operands: tuple[Operand, ...]
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    #: tile loops, outer to inner; each step's ``loops`` is a prefix of it
    loop_order: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    # -------------------------------------------------------------- lookup
    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise ProgramError(f"program {self.name!r}: no dim {name!r}")

    def operand(self, name: str) -> Operand:
        for o in self.operands:
            if o.name == name:
                return o
        raise ProgramError(f"program {self.name!r}: no operand {name!r}")

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise ProgramError(f"program {self.name!r}: no LX buffer {name!r}")

    @property
    def grid(self) -> tuple[Dim, ...]:
        """The dims split over cores, in core-id order (first = slowest)."""
        return tuple(d for d in self.dims if d.cores > 1)

    @property
    def cores_used(self) -> int:
        return math.prod(d.cores for d in self.dims)

    def step_extent(self, step: Step, dim: str) -> int:
        """Elements of ``dim`` one instance of ``step`` sees on the fullest core."""
        d = self.dim(dim)
        return d.tile_size if dim in step.loops else d.core_extent

    def buffer_extents(self, name: str) -> dict[str, int]:
        """Elements per dim the buffer must hold: the largest any step needs."""
        buf = self.buffer(name)
        ext = {d: 1 for d in buf.dims}
        for s in self.steps:
            if name in step_reads(s) or step_writes(s) == name:
                for d in buf.dims:
                    ext[d] = max(ext[d], self.step_extent(s, d))
        return ext

    def buffer_bytes(self, name: str, config: HardwareConfig | None = None) -> int:
        """LX bytes of one copy: the inner dim is padded to whole sticks."""
        buf = self.buffer(name)
        itemsize = buf.dtype.itemsize
        stick = (config.stick_bytes if config else 128) // itemsize
        ext = [self.buffer_extents(name)[d] for d in buf.dims] or [1]
        ext[-1] = ceil_div(ext[-1], stick) * stick
        return math.prod(ext) * itemsize

    def lx_usage(self, config: HardwareConfig | None = None) -> dict[str, int]:
        """LX bytes per buffer on one core, double buffering included (as
        ``buffer_bytes``, with every buffer's extents from one pass over the
        steps: planners ask this of thousands of candidate programs)."""
        ext: dict[str, dict[str, int]] = {b.name: dict.fromkeys(b.dims, 1) for b in self.buffers}
        for s in self.steps:
            w = step_writes(s)
            for name in (*step_reads(s), *((w,) if w is not None else ())):
                e = ext.get(name)
                if e is None:
                    continue
                for d in e:
                    x = self.step_extent(s, d)
                    if x > e[d]:
                        e[d] = x
        out = {}
        for b in self.buffers:
            itemsize = b.dtype.itemsize
            stick = (config.stick_bytes if config else 128) // itemsize
            sizes = [ext[b.name][d] for d in b.dims] or [1]
            sizes[-1] = ceil_div(sizes[-1], stick) * stick
            out[b.name] = math.prod(sizes) * itemsize * (2 if b.double_buffered else 1)
        return out

    def core_span_bytes(self, operand: str) -> int:
        """Device-memory address span one core touches in ``operand`` (fullest core).

        From the lowest to the highest device offset of the core's slice: a
        core's slice of a stick-layout tensor is usually strided, and the
        whole span must fit the core's addressable window.
        """
        op = self.operand(operand)
        lay = op.layout
        step = self._operand_step(operand)
        index = step.index if step is not None else None
        offsets = getattr(step, "offsets", ()) or (0,) * len(lay.host_size)
        # host range of the core at grid coordinate 0 (the fullest one)
        ranges = []
        for k, h in enumerate(lay.host_size):
            d = index[k] if index else None
            o = offsets[k]
            if d and getattr(step, "rows", None) and k == step.rows_dim:
                ranges.append((0, h))  # paged: any row of the operand
            elif d:
                ranges.append((o, o + self.dim(d).core_extent))
            else:
                ranges.append((o, o + 1) if getattr(step, "offsets", ()) else (0, h))
        if not lay.host_size:
            return lay.nbytes
        lo = hi = 0
        for dd, (k, u) in enumerate(zip(lay.dim_map, lay.units)):
            if k < 0:
                continue
            a, b = ranges[k]
            size = lay.device_size[dd]
            c0, c1 = a // u, (b - 1) // u
            if c1 - c0 >= size - 1 or c0 // size != c1 // size:
                c0, c1 = 0, size - 1
            else:
                c0, c1 = c0 % size, c1 % size
            lo += c0 * lay.device_strides[dd]
            hi += c1 * lay.device_strides[dd]
        stick = lay.stick_elems
        return (hi // stick - lo // stick + 1) * stick * lay.itemsize

    def multicast_group(self, load: Load) -> tuple[int, int]:
        """(cores sharing the tile of ``load``, core-id stride between them)."""
        group, stride, acc = 1, 1, 1
        covered = transfer_dims(self, load)
        for d in reversed(self.grid):
            if d.name not in covered:
                if group == 1:
                    stride = acc
                group *= d.cores
            acc *= d.cores
        return group, stride

    def _operand_step(self, operand: str) -> Load | Store | None:
        for s in self.steps:
            if isinstance(s, Load | Store) and s.operand == operand:
                return s
        return None

    # ---------------------------------------------------------- validation
    def validate(self, config: HardwareConfig | None = None) -> Program:
        """Raise ``ProgramError`` (or a subclass) if this cannot run on ``config``."""
        cfg = config or HardwareConfig()
        where = f"kernel program {self.name!r}"
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ProgramError(f"{where}: duplicate dim names {names}")
        for d in self.dims:
            if d.size < 1 or d.cores < 1 or (d.tile is not None and d.tile < 1):
                raise ProgramError(f"{where}: dim {d} needs size, cores and tile >= 1")
            if d.cores > d.size:
                raise ProgramError(
                    f"{where}: dim {d.name!r} of size {d.size} split over {d.cores} cores"
                )
            if d.causal_to is not None and (d.causal_to not in names or d.causal_to == d.name):
                raise ProgramError(
                    f"{where}: dim {d.name!r} is causal to {d.causal_to!r}, which is not "
                    "another dim of the program"
                )
            if d.chunk is not None and not (d.cores - 1) * d.chunk < d.size <= d.cores * d.chunk:
                raise ProgramError(
                    f"{where}: dim {d.name!r}: {d.cores} chunks of {d.chunk} do not cover "
                    f"{d.size} elements with every core non-empty"
                )
        if self.cores_used > cfg.cores:
            raise ProgramError(
                f"{where}: core grid {'x'.join(str(d.cores) for d in self.grid)} needs "
                f"{self.cores_used} cores but the card has {cfg.cores}"
            )
        for lname in self.loop_order:
            if lname not in names:
                raise ProgramError(f"{where}: loop over unknown dim {lname!r}")
        for b in self.buffers:
            for d in b.dims:
                if d not in names:
                    raise ProgramError(f"{where}: buffer {b.name!r} indexed by unknown dim {d!r}")
        buffer_names = {b.name for b in self.buffers}
        operand_names = {o.name for o in self.operands}
        # partial (per-core) dims of each buffer's current value, in program order
        partial: dict[str, set[str]] = {}
        written: set[str] = set()
        for i, s in enumerate(self.steps):
            at = f"{where}, step {i} ({s.kind})"
            if tuple(s.loops) != tuple(self.loop_order[: len(s.loops)]):
                raise ProgramError(
                    f"{at}: loops {list(s.loops)} are not a prefix of {list(self.loop_order)}"
                )
            for r in step_reads(s):
                if r not in buffer_names:
                    raise ProgramError(f"{at}: reads unknown buffer {r!r}")
                if r not in written:
                    raise ProgramError(f"{at}: reads buffer {r!r} before any step writes it")
            w = step_writes(s)
            if w is not None and w not in buffer_names:
                raise ProgramError(f"{at}: writes unknown buffer {w!r}")
            if isinstance(s, Load | Store):
                self._check_transfer(s, at, operand_names)
            if isinstance(s, Store | Vector | Matmul | Scan):
                for r in step_reads(s):
                    if partial.get(r):
                        raise ProgramError(
                            f"{at}: buffer {r!r} holds per-core partial results over "
                            f"{sorted(partial[r])}; combine them with a RingAllReduce first"
                        )
            if isinstance(s, Load):
                partial[s.buffer] = set()
            elif isinstance(s, Vector):
                if s.op not in ops_mod.VECTOR_OPS:
                    raise ProgramError(
                        f"{at}: unknown vector op {s.op!r}; known: {', '.join(sorted(ops_mod.VECTOR_OPS))}"
                        " (add ops with torch_spyre.sim.register_op)"
                    )
                od = ops_mod.VECTOR_OPS[s.op]
                if len(s.inputs) != od.num_inputs:
                    raise ProgramError(f"{at}: op {s.op!r} takes {od.num_inputs} buffer inputs")
                union = set().union(*(self.buffer(x).dims for x in s.inputs))
                # an op without buffer inputs (a fill) writes the whole output buffer
                if od.num_inputs and union != set(self.buffer(s.out).dims):
                    raise ProgramError(
                        f"{at}: output {s.out!r} dims {self.buffer(s.out).dims} must be the "
                        f"union of the input dims {sorted(union)}"
                    )
                partial[s.out] = set()
            elif isinstance(s, Matmul):
                a, b, o = (set(self.buffer(x).dims) for x in (s.a, s.b, s.out))
                k = (a & b) - o
                if not k or o != (a | b) - k:
                    raise ProgramError(
                        f"{at}: matmul dims out {sorted(o)} = a {sorted(a)} x b {sorted(b)} "
                        "must contract the dims a and b share and out lacks"
                    )
                partial[s.out] = {d for d in k if self.dim(d).cores > 1}
            elif isinstance(s, Reduce):
                if s.op not in ops_mod.REDUCTIONS:
                    raise ProgramError(f"{at}: unknown reduction {s.op!r}")
                src = self.buffer(s.input).dims
                if s.dim not in src or set(self.buffer(s.out).dims) != set(src) - {s.dim}:
                    raise ProgramError(
                        f"{at}: reduce of {s.input!r} {src} over {s.dim!r} must write dims "
                        f"{sorted(set(src) - {s.dim})}, not {self.buffer(s.out).dims}"
                    )
                partial[s.out] = set(partial.get(s.input, set()))
                if self.dim(s.dim).cores > 1:
                    partial[s.out].add(s.dim)
            elif isinstance(s, Scan):
                self._check_scan(s, at)
                partial[s.out] = set()
            elif isinstance(s, RingAllReduce):
                if s.op not in ops_mod.REDUCTIONS:
                    raise ProgramError(f"{at}: unknown reduction {s.op!r}")
                if s.dim not in partial.get(s.buffer, set()):
                    raise ProgramError(
                        f"{at}: buffer {s.buffer!r} holds no per-core partials over "
                        f"{s.dim!r} (dim split over {self.dim(s.dim).cores} cores)"
                    )
                partial[s.buffer] = partial[s.buffer] - {s.dim}
            if w is not None:
                written.add(w)
        for o in self.operands:
            if o.role in ("output", "inout") and not any(
                isinstance(s, Store) and s.operand == o.name for s in self.steps
            ):
                raise ProgramError(f"{where}: output operand {o.name!r} is never stored")
        self._check_lx(cfg, where)
        self._check_span(cfg, where)
        return self

    def _check_scan(self, s: Scan, at: str) -> None:
        if s.op not in SCANS or len(s.inputs) not in SCANS[s.op]:
            raise ProgramError(
                f"{at}: unknown scan {s.op!r} with {len(s.inputs)} inputs; known: "
                + ", ".join(f"{k} ({'/'.join(map(str, v))} inputs)" for k, v in SCANS.items())
            )
        out = set(self.buffer(s.out).dims)
        if s.dim not in out:
            raise ProgramError(f"{at}: scan over {s.dim!r} but {s.out!r} has dims {sorted(out)}")
        if self.dim(s.dim).cores > 1:
            raise ProgramError(
                f"{at}: scan over {s.dim!r}, which is split over {self.dim(s.dim).cores} cores: "
                "a scan walks its dim in order on one core"
            )
        scanned = s.inputs[:2] if s.op == "linrec" else s.inputs
        for x in scanned:
            if not set(self.buffer(x).dims) <= out:
                raise ProgramError(
                    f"{at}: scan input {x!r} dims {self.buffer(x).dims} are not dims of {s.out!r}"
                )
        if len(s.inputs) == 3:
            init = set(self.buffer(s.inputs[2]).dims)
            if s.dim in init or not init <= out:
                raise ProgramError(
                    f"{at}: scan init {s.inputs[2]!r} must have dims of {s.out!r} without {s.dim!r}"
                )

    def _check_transfer(self, s: Load | Store, at: str, operand_names: set[str]) -> None:
        if s.operand not in operand_names:
            raise ProgramError(f"{at}: unknown operand {s.operand!r}")
        op = self.operand(s.operand)
        if isinstance(s, Store) and op.role == "input":
            raise ProgramError(f"{at}: stores into input operand {op.name!r}")
        lay = op.layout
        if len(s.index) != len(lay.host_size):
            raise ProgramError(
                f"{at}: index {list(s.index)} must name one dim per host dim of "
                f"{op.name!r} {list(lay.host_size)}"
            )
        offsets = getattr(s, "offsets", ())
        if offsets and len(offsets) != len(lay.host_size):
            raise ProgramError(
                f"{at}: offsets {list(offsets)} must give one offset per host dim of "
                f"{op.name!r} {list(lay.host_size)}"
            )
        if s.rows:
            self._check_rows(s, at, lay)
        for k, d in enumerate(s.index):
            off = offsets[k] if offsets else 0
            n = 1 if d is None else self.dim(d).size
            if s.rows and k == s.rows_dim:
                continue  # any row of the operand: checked against the table
            if offsets:
                if off < 0 or off + n > lay.host_size[k]:
                    raise ProgramError(
                        f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]}; "
                        f"reading {n} elements from offset {off} runs past it"
                    )
                if k == lay.stick_dim and off % lay.stick_elems:
                    raise ProgramError(
                        f"{at}: offset {off} into the stick dim of {op.name!r} is not whole "
                        f"sticks of {lay.stick_elems} elements (a DMA cannot shift lanes)"
                    )
            elif d is None:
                if lay.host_size[k] != 1:
                    raise ProgramError(
                        f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]}, not 1"
                    )
            elif self.dim(d).size != lay.host_size[k]:
                raise ProgramError(
                    f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]} but "
                    f"dim {d!r} has size {self.dim(d).size}"
                )
        if isinstance(s, Store) and lay.host_size:
            d = s.index[lay.stick_dim]
            if (
                d is not None
                and self.dim(d).cores > 1
                and self.dim(d).core_extent % lay.stick_elems
            ):
                raise ProgramError(
                    f"{at}: dim {d!r} is the stick dim of {op.name!r} and is split over cores "
                    f"in chunks of {self.dim(d).core_extent}, not whole sticks of "
                    f"{lay.stick_elems}: two cores would write the same stick. Set "
                    f"Dim(chunk=...) to a multiple of {lay.stick_elems}."
                )
        idx = list(transfer_dims(self, s))
        if isinstance(s, Load) and s.multicast and not self.multicast_group(s)[0] > 1:
            raise ProgramError(
                f"{at}: multicast load of {op.name!r} but no dim split over cores is "
                f"missing from its index {list(s.index)}: every core needs a different tile"
            )
        buf = self.buffer(s.buffer)
        if sorted(idx) != sorted(buf.dims):
            raise ProgramError(
                f"{at}: operand {op.name!r} indexed by {idx} but buffer {buf.name!r} has dims {list(buf.dims)}"
            )

    def _check_rows(self, s: Load | Store, at: str, lay: SpyreTensorLayout) -> None:
        table = self.buffer(s.rows)
        if table.dtype not in (torch.int32, torch.int64):
            raise ProgramError(f"{at}: row table {s.rows!r} must be int32/int64, not {table.dtype}")
        if not 0 <= s.rows_dim < len(lay.host_size) or s.rows_dim == lay.stick_dim:
            raise ProgramError(
                f"{at}: rows_dim {s.rows_dim} must name a host dim of {s.operand!r} other than "
                f"its stick dim {lay.stick_dim} (a DMA descriptor addresses whole sticks)"
            )
        d = s.index[s.rows_dim]
        if d is None or table.dims[-1] != d:
            raise ProgramError(
                f"{at}: host dim {s.rows_dim} of {s.operand!r} is indexed by {d!r}, which must "
                f"be the last dim of its row table {s.rows!r} {list(table.dims)}"
            )
        if s.rows_run < 1:
            raise ProgramError(f"{at}: rows_run must be >= 1")

    def _check_lx(self, cfg: HardwareConfig, where: str) -> None:
        usage = self.lx_usage(cfg)
        total = sum(usage.values())
        if total > cfg.lx_bytes:
            detail = ", ".join(
                f"{n} {list(self.buffer_extents(n).values())} {self.buffer(n).dtype}"
                f"{' x2 (double buffered)' if self.buffer(n).double_buffered else ''} = {_fmt_bytes(b)}"
                for n, b in usage.items()
            )
            tiles = ", ".join(f"{d.name}={d.tile_size}" for d in self.dims)
            raise LXOverflowError(
                f"{where} needs {_fmt_bytes(total)} of LX per core but a core has "
                f"{_fmt_bytes(cfg.lx_bytes)}: {detail}. Use smaller tiles (now {tiles}), "
                "split over more cores, or drop double buffering."
            )

    def _check_span(self, cfg: HardwareConfig, where: str) -> None:
        spans = {o.name: self.core_span_bytes(o.name) for o in self.operands}
        total = sum(spans.values())
        if total > cfg.per_core_span_bytes:
            detail = ", ".join(f"{n} {_fmt_bytes(b)}" for n, b in spans.items())
            raise SpanError(
                f"{where}: one core addresses {_fmt_bytes(total)} of device memory ({detail}) "
                f"but a core's span is {_fmt_bytes(cfg.per_core_span_bytes)}. Split the work "
                "over more cores or into several kernels."
            )

    # ------------------------------------------------------------ dumping
    def dump(self) -> str:
        grid = " x ".join(f"{d.name}:{d.cores}" for d in self.grid) or "1"
        out = [f"kernel {self.name}  cores {self.cores_used} (grid {grid})"]
        out.append(
            "  dims     "
            + ", ".join(
                f"{d.name}={d.size}"
                + (f"/{d.cores}" if d.cores > 1 else "")
                + f" tile {d.tile_size}"
                + (f" (causal to {d.causal_to})" if d.causal_to else "")
                for d in self.dims
            )
        )
        for o in self.operands:
            lay = o.layout
            out.append(
                f"  {o.role:<8} {o.name}: {list(lay.host_size)} {str(lay.dtype).removeprefix('torch.')}"
                f" device {list(lay.device_size)} stride_map {list(lay.stride_map)}"
            )
        usage = self.lx_usage()
        for b in self.buffers:
            ext = self.buffer_extents(b.name)
            out.append(
                f"  lx       {b.name}[{', '.join(f'{d}:{ext[d]}' for d in b.dims)}] "
                f"{str(b.dtype).removeprefix('torch.')}{' x2' if b.double_buffered else ''}"
                f" = {_fmt_bytes(usage[b.name])}"
            )
        out.append(f"  lx total {_fmt_bytes(sum(usage.values()))} per core")
        open_loops = 0
        for s in self.steps:
            while open_loops > len(s.loops):
                open_loops -= 1
                out.append("  " + "  " * open_loops + "end")
            while open_loops < len(s.loops):
                d = self.dim(self.loop_order[open_loops])
                out.append("  " + "  " * open_loops + f"for {d.name} in tiles of {d.tile_size}:")
                open_loops += 1
            out.append("  " + "  " * open_loops + "  " + _step_text(s))
        while open_loops:
            open_loops -= 1
            out.append("  " + "  " * open_loops + "end")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.dump()

    # --------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dims": [d.__dict__ for d in self.dims],
            "operands": [
                {
                    "name": o.name,
                    "role": o.role,
                    "host_size": list(o.layout.host_size),
                    "device_size": list(o.layout.device_size),
                    "dim_map": list(o.layout.dim_map),
                    "dtype": _dtype_name(o.layout.dtype),
                }
                for o in self.operands
            ],
            "buffers": [
                {
                    "name": b.name,
                    "dims": list(b.dims),
                    "dtype": _dtype_name(b.dtype),
                    "double_buffered": b.double_buffered,
                }
                for b in self.buffers
            ],
            "steps": [_step_dict(s) for s in self.steps],
            "loop_order": list(self.loop_order),
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Program:
        try:
            return Program(
                name=d["name"],
                dims=tuple(Dim(**x) for x in d["dims"]),
                operands=tuple(
                    Operand(
                        x["name"],
                        SpyreTensorLayout(
                            tuple(x["host_size"]),
                            tuple(x["device_size"]),
                            tuple(x["dim_map"]),
                            _dtype(x["dtype"]),
                        ),
                        x["role"],
                    )
                    for x in d["operands"]
                ),
                buffers=tuple(
                    Buffer(x["name"], tuple(x["dims"]), _dtype(x["dtype"]), x["double_buffered"])
                    for x in d["buffers"]
                ),
                steps=tuple(_step_from_dict(x) for x in d["steps"]),
                loop_order=tuple(d.get("loop_order", ())),
                meta=dict(d.get("meta", {})),
            )
        except (KeyError, TypeError) as e:
            raise ProgramError(f"malformed kernel program JSON: {e!r}") from None

    @staticmethod
    def from_json(text: str) -> Program:
        return Program.from_dict(json.loads(text))


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ProgramError(f"unknown dtype {name!r}")
    return dt


def _step_dict(s: Step) -> dict[str, Any]:
    d = dict(s.__dict__)
    for k, v in d.items():
        if isinstance(v, tuple):
            d[k] = list(v)
    return d


def _step_from_dict(d: dict[str, Any]) -> Step:
    d = dict(d)
    cls = _STEP_TYPES.get(d.pop("kind", None))
    if cls is None:
        raise ProgramError(f"unknown step kind in {d}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _idx(index: tuple[str | None, ...], s: Load | Store | None = None) -> str:
    names = [d if d is not None else "0" for d in index]
    if s is not None and s.rows:  # paged: that dim's rows come from the table
        names[s.rows_dim] = f"{s.rows}[{names[s.rows_dim]}]"
    return ", ".join(names)


def _step_text(s: Step) -> str:
    if isinstance(s, Load):
        mc = "   (multicast over the ring)" if s.multicast else ""
        at = f" from {list(s.offsets)}" if any(s.offsets) else ""
        return f"load   {s.buffer} <- {s.operand}[{_idx(s.index, s)}]{at}{mc}"
    if isinstance(s, Store):
        at = f" at {list(s.offsets)}" if any(s.offsets) else ""
        return f"store  {s.operand}[{_idx(s.index, s)}]{at} <- {s.buffer}"
    if isinstance(s, Matmul):
        return f"matmul {s.out} += {s.a} @ {s.b}   (PE array)"
    if isinstance(s, Vector):
        args = list(s.inputs) + [repr(x) for x in s.scalars]
        return f"vector {s.out} = {s.op}({', '.join(args)})"
    if isinstance(s, Reduce):
        return f"reduce {s.out} = {s.op}({s.input}, over {s.dim})"
    if isinstance(s, Scan):
        return f"scan   {s.out} = {s.op}({', '.join(s.inputs)}, along {s.dim})   (sequential)"
    return f"ring   allreduce-{s.op} {s.buffer} over cores splitting {s.dim}"
