"""The pieces of a kernel program (ir/program.py): its dims, operands, LX
buffers and steps, which buffers each step reads and writes, and the
program errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from torch_spyre.layout import SpyreTensorLayout, ceil_div


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
    #: the dim an op that moves data along one dim acts on (``rotate_half``)
    dim: str | None = None
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


class _HasBuffers(Protocol):
    def buffer(self, name: str) -> Buffer: ...


def transfer_dims(p: _HasBuffers, s: Load | Store) -> tuple[str, ...]:
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
