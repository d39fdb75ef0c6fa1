"""What one step of a kernel program costs one core (``sim/timing.py``
sums it): each core's view of the dims (extents, starts, tiles), what a
step's cost depends on that no core changes (``_Steps``, looked up once per
program), the phases of a program with sibling loops, and the cycles, DMA
and ring bytes of a load, store, matmul, vector step, reduction, scan or
ring all-reduce over all of a core's instances of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from torch_spyre.hardware import HardwareConfig, pe_rate
from torch_spyre.ir import (
    Load,
    Matmul,
    Program,
    Reduce,
    RingAllReduce,
    Scan,
    Step,
    Store,
    Vector,
    transfer_dims,
)
from torch_spyre.ir import vector_ops as ops_mod


# ------------------------------------------------------------ per-dim sums
def _tile_lengths(extent: int, tile: int) -> tuple[int, int, int]:
    """(tiles, full tiles, length of the last partial tile or 0)."""
    if extent <= 0:
        return 0, 0, 0
    n = -(-extent // tile)
    rem = extent - (n - 1) * tile
    return (n, n, 0) if rem == tile else (n, n - 1, rem)


def _sum_over_tiles(extent: int, tile: int, f) -> float:
    n, full, rem = _tile_lengths(extent, tile)
    return full * f(tile) + (f(rem) if rem else 0)


def _stick_sum(start: int, extent: int, tile: int, se: int) -> int:
    """Sticks touched along the stick dim, summed over the tiles of a range."""
    n, _, _ = _tile_lengths(extent, tile)
    if start % se == 0 and tile % se == 0:
        return _sum_over_tiles(extent, tile, lambda n_: -(-n_ // se))
    total = 0
    for i in range(n):  # one dim's tiles only, and only for unaligned tiles
        lo = start + i * tile
        hi = min(lo + tile, start + extent)
        total += -(-hi // se) - lo // se
    return total


class _CoreView:
    """Extents, starts and tiles of every dim on one core."""

    __slots__ = ("p", "coords", "stick_bytes", "extent", "start", "tile", "ntiles")

    def __init__(self, program: Program, coords: dict[str, int], stick_bytes: int) -> None:
        self.p = program
        self.coords = coords
        self.stick_bytes = stick_bytes
        self.extent: dict[str, int] = {}
        self.start: dict[str, int] = {}
        #: elements per tile (Dim.tile_size) and tiles of the core's range
        self.tile: dict[str, int] = {}
        self.ntiles: dict[str, int] = {}
        for d in program.dims:
            ce = d.core_extent
            if d.cores > 1:
                c = coords[d.name]
                e, s0 = max(0, min(d.size - c * ce, ce)), c * ce
            else:
                e, s0 = d.size, 0
            t = min(d.tile or ce, ce)
            self.extent[d.name], self.start[d.name], self.tile[d.name] = e, s0, t
            self.ntiles[d.name] = -(-e // t) if e > 0 else 0

    def dim_sum(self, step: Step, dim: str, f=None) -> float:
        """Sum over the step's instances along ``dim`` of f(length) (None: the
        length itself, whose sum is the extent)."""
        e = self.extent[dim]
        if f is None:
            return e
        if dim in step.loops:
            return _sum_over_tiles(e, self.tile[dim], f)
        return f(e) if e > 0 else 0

    def count(self, step: Step, dims: tuple[str, ...]) -> int:
        """Instances of ``step`` per combination of ``dims`` (loops it repeats over)."""
        n = 1
        for d in step.loops:
            if d not in dims:
                n *= self.ntiles[d]
        return n

    def instances(self, loops: tuple[str, ...]) -> int:
        n = 1
        for d in loops:
            n *= self.ntiles[d]
        return n


# -------------------------------------------------------------- step costs
class _Steps:
    """What the cost of each step depends on that no core changes: looked up
    once per program instead of once per step and core (planners ask the
    model about thousands of candidate programs)."""

    def __init__(self, p: Program, cfg: HardwareConfig) -> None:
        grid = p.grid
        self.causal = [d for d in p.dims if d.causal_to is not None]
        self.shared_pages = _shared_page_loads(p)
        #: sibling loops (``Program.branches``): each branch is a pipeline
        #: of its own, run after the one before (``_phases``); otherwise one
        #: phase, the whole nest
        self.phase, self.phase_loops = _phases(p)
        # the innermost loop body of a phase is a pipeline if its transfers
        # are double buffered; a transfer of a single-buffered buffer stalls
        # it (serial)
        piped = {
            ph: len(loops) > 0
            and all(
                p.buffer(s.buffer).double_buffered
                for s, sp in zip(p.steps, self.phase)
                if sp == ph and isinstance(s, Load | Store) and len(s.loops) == len(loops)
            )
            for ph, loops in self.phase_loops.items()
        }
        self.pipelined = all(piped.values())
        self.info: list[tuple] = []
        self.overlaps: list[bool] = []
        for s, ph in zip(p.steps, self.phase):
            self.overlaps.append(
                piped.get(ph, False)
                and bool(s.loops)
                and (not isinstance(s, Load | Store) or p.buffer(s.buffer).double_buffered)
            )
            if isinstance(s, Load | Store):
                dims = transfer_dims(p, s)
                # stores: only cores at coordinate 0 of split dims missing from
                # the index write (the others hold replicas)
                replica = (
                    tuple(d.name for d in grid if d.name not in dims)
                    if isinstance(s, Store)
                    else ()
                )
                lay = p.operand(s.operand).layout
                stick_dim = lay.stick_dim if lay.host_size else -1
                offsets = getattr(s, "offsets", ()) or (0,) * len(s.index)
                mc = _multicast(p, s) if isinstance(s, Load) and s.multicast else None
                paged = None
                if s.rows:
                    table = p.buffer(s.rows).dims
                    pd = s.index[s.rows_dim]
                    others = tuple(t for t in table if t != pd and t not in s.index)
                    paged = (
                        pd,
                        s.rows_run,
                        others,
                        # the step's other loops over its own dims: each tile
                        # of them is a transfer of its own (a head of a
                        # heads-first cache), with its own descriptors
                        tuple(d for d in s.loops if d in dims and d != pd and d not in others),
                    )
                self.info.append((dims, replica, lay.stick_elems, stick_dim, offsets, mc, paged))
            elif isinstance(s, Matmul):
                a, b, o = (p.buffer(x) for x in (s.a, s.b, s.out))
                k = [d for d in a.dims if d in b.dims and d not in o.dims]
                m = [d for d in a.dims if d not in b.dims]
                n = [d for d in b.dims if d not in a.dims]
                batch = [d for d in o.dims if d in a.dims and d in b.dims]
                involved = tuple(dict.fromkeys(batch + m + n + k))
                # the PE array quantises each role's innermost dim: rows (M),
                # columns across both corelets (N), lanes (K)
                quant = []
                for role, q in (
                    (m, cfg.pe_rows),
                    (n, cfg.pe_cols * cfg.corelets_per_core),
                    (k, cfg.pe_lanes),
                ):
                    for i, d in enumerate(role):
                        quant.append((d, _ceil_by(q) if i == len(role) - 1 else None))
                self.info.append((involved, tuple(quant), tuple(batch), pe_rate(a.dtype, b.dtype)))
            elif isinstance(s, Vector):
                out = p.buffer(s.out)
                per_stick = cfg.sfu_cycles(ops_mod.vector_op(s.op).cost_class)
                self.info.append((out.dims, _lanes(cfg, out.dtype), per_stick))
            elif isinstance(s, Reduce):
                src, out = p.buffer(s.input), p.buffer(s.out)
                per_stick = cfg.sfu_reduction_cycles + sum(
                    cfg.sfu_cycles(c) for c in ops_mod.reduction(s.op).extra_cost
                )
                along_stick = src.dims[-1] == s.dim
                self.info.append(
                    (src.dims, out.dims, _lanes(cfg, src.dtype), per_stick, along_stick)
                )
            else:
                self.info.append(())


def _phases(p: Program) -> tuple[list[int], dict[int, tuple[str, ...]]]:
    """Each step's phase and each phase's loop nest (its deepest loops).

    A program whose steps' loops are prefixes of its loop order is one
    phase (0), its nest the whole loop order: its looped steps form one
    pipeline.  With sibling loops (``Program.branches``: a prologue
    contracting its own dim before the main loops), the looped steps below
    the loops they all share are grouped by the first loop they do not
    share, one phase per sibling (1, 2, ...), each a pipeline of its own;
    those inside only the shared loops are phase 0.  Phases run one after
    another: a memory-bound prologue is not hidden under a compute-bound
    main loop (its transfers cannot run ahead into LX the main loop's tiles
    have not freed), so their times add."""
    if not p.branches:
        return [0] * len(p.steps), {0: tuple(p.loop_order)}
    looped = [tuple(s.loops) for s in p.steps if s.loops]
    shared = 0
    while all(len(x) > shared and x[shared] == looped[0][shared] for x in looped):
        shared += 1
    firsts: dict[str, int] = {}
    phase: list[int] = []
    nests: dict[int, tuple[str, ...]] = {0: looped[0][:shared]}
    for s in p.steps:
        loops = tuple(s.loops)
        if len(loops) <= shared:
            phase.append(0)
            continue
        ph = firsts.setdefault(loops[shared], len(firsts) + 1)
        phase.append(ph)
        if len(loops) > len(nests.get(ph, ())):
            nests[ph] = loops
    return phase, nests


def _ceil_by(q: int):
    return lambda x: -(-x // q)


def _multicast(p: Program, s: Load) -> tuple[int, int, int]:
    """(group, stride, active) of a multicast load: the cores sharing its tile
    and the core-id stride between them (``Program.multicast_group``), and
    how many of them read it: a core whose range of a group dim the load
    loops over is empty moves nothing (five rows over four cores: the fourth
    has none), so the tile is shared by the others only.  Dividing by the
    whole group would charge a quarter of the weight to no core."""
    group, stride = p.multicast_group(s)
    covered = transfer_dims(p, s)
    active = 1
    for d in p.grid:
        if d.name in covered:
            continue
        if d.name in s.loops:
            ce = d.core_extent
            active *= sum(1 for c in range(d.cores) if d.size - c * ce > 0)
        else:
            active *= d.cores
    return group, stride, max(active, 1)


def _transfer(cv: _CoreView, s: Load | Store, info: tuple) -> tuple[float, float]:
    """(transfers, bytes) of a load/store on this core."""
    dims, replica, se, stick_dim, offsets, _mc, paged = info
    coords = cv.coords
    for d in replica:
        if coords[d] != 0:
            return 0.0, 0.0
    sticks = cv.count(s, dims)
    # a size-1 (None) stick dim still costs one whole stick per row
    for k, d in enumerate(s.index):
        if d is None:
            continue
        if k == stick_dim:
            t = cv.tile[d] if d in s.loops else cv.extent[d]
            sticks *= _stick_sum(cv.start[d] + offsets[k], cv.extent[d], t, se)
        else:
            sticks *= cv.extent[d]
    if paged is None:
        return float(cv.instances(s.loops)), float(sticks * cv.stick_bytes)
    # paged: the table's other dims (a request each) multiply the sticks; one
    # DMA descriptor per run of consecutive rows (a page) of each of them
    pd, run, others, tiled = paged
    transfers = cv.count(s, dims) * cv.dim_sum(s, pd, lambda n: -(-n // run))
    for d in tiled:
        transfers *= cv.ntiles[d]
    for t in others:
        sticks *= cv.extent[t]
        transfers *= cv.extent[t]
    return float(transfers), float(sticks * cv.stick_bytes)


def _vector_sticks(cv: _CoreView, s: Step, dims: tuple[str, ...], lanes: int) -> float:
    """Vector-unit sticks of a buffer with ``dims`` over the step's instances."""
    if not dims:
        return cv.count(s, ())
    total = cv.count(s, dims)
    for d in dims[:-1]:
        total *= cv.extent[d]
    return total * cv.dim_sum(s, dims[-1], lambda n: -(-n // lanes))


def _lanes(cfg: HardwareConfig, dtype: torch.dtype) -> int:
    return max(1, int(cfg.vector_lanes * min(1.0, 2 / dtype.itemsize)))


def _matmul_cycles(cv: _CoreView, s: Matmul, cfg: HardwareConfig, info: tuple) -> float:
    involved, quant, batch, rate = info
    cyc = cv.count(s, involved)
    for d, f in quant:
        cyc *= cv.dim_sum(s, d, f)
    for d in batch:
        cyc *= cv.extent[d]
    fill = cfg.pe_rows + cfg.pe_cols  # systolic fill and drain per tile
    return cyc / rate + fill * cv.instances(s.loops)


def _group_stride(program: Program, dim: str) -> int:
    """Core-id distance between neighbours of the group splitting ``dim``."""
    stride = 1
    for d in reversed(program.grid):
        if d.name == dim:
            return stride
        stride *= d.cores
    return stride


@dataclass
class _Cost:
    """What one step costs one core over all its instances."""

    cycles: dict[str, float] = field(default_factory=dict)
    setup: float = 0.0  # DMA set-up cycles (part of cycles["dma"])
    dram_bytes: float = 0.0
    ring_bytes: float = 0.0


def _step_cost(
    cv: _CoreView,
    s: Step,
    cfg: HardwareConfig,
    cycles_per_byte: float,
    info: tuple,
    moved: tuple[float, float] | None,
) -> _Cost:
    """``info``: the step's ``_Steps.info``; ``moved``: a transfer's ``_transfer``."""
    p = cv.p
    if isinstance(s, Load | Store):
        n, nbytes = moved
        cost = _Cost()
        mc = info[5]
        if mc is not None:
            # each core of the group that reads reads 1/active, the ring
            # all-gathers the rest
            group, stride, active = mc
            cost.ring_bytes = (active - 1) / active * nbytes
            ring = cost.ring_bytes / (2 * cfg.ring_bytes_per_cycle) * stride
            cost.cycles["ring"] = ring + n * (group // 2) * stride * cfg.ring_hop_cycles
            nbytes /= active
        cost.setup = n * cfg.dma_setup_cycles
        cost.cycles["dma"] = cost.setup + nbytes * cycles_per_byte
        cost.dram_bytes = nbytes
        return cost
    if isinstance(s, Matmul):
        return _Cost({"pe": _matmul_cycles(cv, s, cfg, info)})
    if isinstance(s, Vector):
        dims, lanes, per_stick = info
        sticks = _vector_sticks(cv, s, dims, lanes)
        return _Cost({"vector": sticks * per_stick / cfg.corelets_per_core})
    if isinstance(s, Reduce):
        src_dims, out_dims, lanes, per_stick, along_stick = info
        sticks = _vector_sticks(cv, s, src_dims, lanes)
        outs = cv.count(s, out_dims) * math.prod(cv.extent[d] for d in out_dims)
        # a reduction along the stick ends in a cross-lane tree per output
        tree = outs * cfg.sfu_reduction_tree_cycles if along_stick else 0
        return _Cost({"vector": (sticks * per_stick + tree) / cfg.corelets_per_core})
    if isinstance(s, Scan):
        # element i waits for element i - 1: the scanned dim is walked one
        # element at a time, the vector lanes cover the other dims
        out = p.buffer(s.out)
        rest = tuple(d for d in out.dims if d != s.dim)
        lanes = _lanes(cfg, out.dtype)
        sticks = cv.count(s, out.dims) * cv.dim_sum(s, s.dim)
        for d in rest[:-1]:
            sticks *= cv.dim_sum(s, d)
        if rest:
            sticks *= cv.dim_sum(s, rest[-1], lambda n: -(-n // lanes))
        # linrec: a multiply and an add per element
        per = (2 if s.op == "linrec" else 1) * cfg.sfu_cycles("simple")
        return _Cost({"vector": sticks * per / cfg.corelets_per_core})
    assert isinstance(s, RingAllReduce)
    buf = p.buffer(s.buffer)
    group = p.dim(s.dim).cores
    stride = _group_stride(p, s.dim)
    sticks = _vector_sticks(cv, s, buf.dims, cfg.stick_bytes // buf.dtype.itemsize)
    # bidirectional ring: reduce-scatter + all-gather, each core sends
    # 2(P-1)/P of the data, half each way; interleaved groups share links
    sent = 2 * (group - 1) / group * sticks * cfg.stick_bytes
    instances = cv.instances(s.loops)
    ring = sent / (2 * cfg.ring_bytes_per_cycle) * stride
    ring += instances * 2 * (group - 1) * stride * cfg.ring_hop_cycles
    # the combining adds of the reduce-scatter run on the vector units
    vec = (group - 1) / group * sticks / cfg.corelets_per_core
    return _Cost({"ring": ring, "vector": vec}, ring_bytes=sent)


def _shared_page_loads(p: Program) -> set[int]:
    """Paged loads (stores) whose pages an earlier one's descriptors already move.

    Two loads (or stores) through the same row table in the same loop that read
    adjacent sticks of each row (a KV cache's key and value sticks of a
    slot and head lie side by side in its stick layout) are one strided DMA
    per page: the later one costs its bytes, not another descriptor set-up.
    """
    out: set[int] = set()
    seen: dict[tuple, tuple[int, ...]] = {}
    for i, s in enumerate(p.steps):
        if not (isinstance(s, Load | Store) and s.rows):
            continue
        key = (type(s), s.operand, s.rows, s.rows_dim, s.loops, s.index)
        offs = s.offsets or (0,) * len(s.index)
        prev = seen.get(key)
        if prev is None:
            seen[key] = offs
            continue
        differ = [k for k, (a, b) in enumerate(zip(prev, offs)) if a != b]
        if len(differ) == 1 and s.index[differ[0]] is None:
            lay = p.operand(s.operand).layout
            tab = lay.dim_offsets[differ[0]]
            if abs(int(tab[offs[differ[0]]]) - int(tab[prev[differ[0]]])) == lay.stick_elems:
                out.add(i)
    return out


def _causal_fraction(cv: _CoreView, loops: tuple[str, ...], causal: list) -> float:
    """Fraction of the instances of a step inside ``loops`` that run on this
    core: a tile of a dim with ``causal_to`` set that starts after the last
    position of the current tile of its partner dim is skipped (attention
    blocks above the diagonal).  Exact count of the (partner tile, tile)
    pairs, one partner tile at a time.  ``causal``: the program's dims with
    ``causal_to``."""
    frac = 1.0
    for d in causal:
        if d.name not in loops:
            continue
        nk = cv.ntiles[d.name]
        q = d.causal_to
        eq = cv.extent[q]
        tq = cv.tile[q] if q in loops else eq
        nq = _tile_lengths(eq, tq)[0]
        if not nk or not nq:
            continue
        k0, q0, tk = cv.start[d.name], cv.start[q], d.tile_size
        active = 0
        for i in range(nq):
            last = q0 + min((i + 1) * tq, eq) - 1
            if last >= k0:
                active += min(nk, (last - k0) // tk + 1)
        frac *= active / (nq * nk)
    return frac


def _transfers(p: Program, cv: _CoreView, st: _Steps) -> list[tuple[float, float] | None]:
    """``_transfer`` of every load/store of ``p`` on this core (None: other steps)."""
    return [
        _transfer(cv, s, st.info[i]) if isinstance(s, Load | Store) else None
        for i, s in enumerate(p.steps)
    ]


def _dram_bytes(p: Program, cv: _CoreView, st: _Steps, moved: list) -> float:
    total = 0.0
    for i, s in enumerate(p.steps):
        if isinstance(s, Load | Store):
            nbytes = moved[i][1] * _causal_fraction(cv, s.loops, st.causal)
            mc = st.info[i][5]
            if mc is not None:
                nbytes /= mc[2]
            total += nbytes
    return total
