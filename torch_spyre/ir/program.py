"""The kernel program: one serialisable SPMD dataflow kernel.

Every producer (eager ops, the compiler) emits one of these; the simulated
card validates, executes and times it.  The model:

* an **iteration space** of named dims (``Dim``), each split evenly over
  ``cores`` cores (the core grid is the product of the splits, row-major in
  dim order) and walked by each core in tiles of ``tile`` elements;
* **operands**: device tensors (inputs / outputs) with their stick layouts;
* **LX buffers**: named scratchpad tensors indexed by iteration dims, single
  or double buffered; their size per core follows from the tiles;
* **steps**, in program order, each nested in ``loops``, dims of the tile
  loop order in that order (usually a prefix of it; consecutive steps share
  their common outer loops, and a step whose loops leave a deeper loop of
  the step before closes it: a prologue may contract its own dim in a loop
  that runs before the main loops, inside the same outer loops): stick-granular ``Load``/``Store`` between an operand and a
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

The pieces and which buffers each step reads and writes are in ``steps.py``;
``Program.validate`` in ``program_checks.py``; its text and JSON forms in
``program_text.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir.program_checks import ProgramChecks
from torch_spyre.ir.program_text import ProgramText

# the program's vocabulary (its pieces live in ir/steps.py) is imported from here
from torch_spyre.ir.steps import (
    SCANS,
    Buffer,
    Dim,
    Load,
    LXOverflowError,
    Matmul,
    Operand,
    ProgramError,
    Reduce,
    RingAllReduce,
    Scan,
    SpanError,
    Step,
    Store,
    Vector,
    sole_load,
    step_reads,
    step_writes,
    transfer_dims,
)
from torch_spyre.layout import ceil_div

__all__ = [
    "SCANS",
    "Buffer",
    "Dim",
    "LXOverflowError",
    "Load",
    "Matmul",
    "Operand",
    "Program",
    "ProgramError",
    "Reduce",
    "RingAllReduce",
    "Scan",
    "SpanError",
    "Step",
    "Store",
    "Vector",
    "sole_load",
    "step_reads",
    "step_writes",
    "transfer_dims",
]


# ----------------------------------------------------------------- program
@dataclass(frozen=True)
class Program(ProgramChecks, ProgramText):
    name: str
    dims: tuple[Dim, ...]
    operands: tuple[Operand, ...]
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    #: tile loops, outer to inner; each step's ``loops`` is a subsequence of it
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

    def nests_in_order(self, loops: tuple[str, ...]) -> bool:
        """Whether ``loops`` is an ordered subsequence of ``loop_order``."""
        it = iter(self.loop_order)
        return all(d in it for d in loops)

    @property
    def branches(self) -> bool:
        """Whether some step's loops are not a prefix of ``loop_order``: the
        nest has sibling loops over different dims (a prologue's own
        contraction loop before the main loops), which run one after the
        other inside their common loops."""
        return any(tuple(s.loops) != self.loop_order[: len(s.loops)] for s in self.steps)

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
        ext = self.lx_extents()
        out = {}
        for b in self.buffers:
            itemsize = b.dtype.itemsize
            stick = (config.stick_bytes if config else 128) // itemsize
            sizes = [ext[b.name][d] for d in b.dims] or [1]
            sizes[-1] = ceil_div(sizes[-1], stick) * stick
            out[b.name] = math.prod(sizes) * itemsize * (2 if b.double_buffered else 1)
        return out

    def lx_extents(self) -> dict[str, dict[str, int]]:
        """Every buffer's ``buffer_extents`` from one pass over the steps."""
        ext: dict[str, dict[str, int]] = {b.name: dict.fromkeys(b.dims, 1) for b in self.buffers}
        dims = {d.name: d for d in self.dims}  # (``step_extent``, without a search per dim)
        for s in self.steps:
            w = step_writes(s)
            for name in (*step_reads(s), *((w,) if w is not None else ())):
                e = ext.get(name)
                if e is None:
                    continue
                for d in e:
                    x = dims[d].tile_size if d in s.loops else dims[d].core_extent
                    if x > e[d]:
                        e[d] = x
        return ext

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
