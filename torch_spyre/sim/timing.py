"""The timing model: modelled cycles of a kernel program on a configured card.

Closed form per tile loop, never per element and never per tile instance:

* Each step's work over a core's tile loops is a product of per-dim factors
  (a tile count, elements or sticks per tile summed over the tiles of a dim),
  so totals come from sums over one dim at a time.
* Per core, four units run concurrently: the DMA engine (loads and stores,
  ``dma_setup_cycles`` each plus bytes at the core's share of bandwidth), the
  PE arrays (matmul tiles), the vector units (elementwise and reductions, by
  cost class) and the ring port.  When every buffer moved inside the tile
  loops is double buffered, the loop body is a pipeline over ``n`` iterations:
  ``T = max_u B_u + (sum_u B_u - max_u B_u) / n`` (one iteration of fill and
  drain, then the busiest unit sets the pace); sibling loops
  (``Program.branches``) are one pipeline each, one after the other
  (``step_costs._phases``).  Otherwise steps serialise:
  ``T = sum_u B_u``.  Steps outside every loop run serially around the loop.
* All cores using memory share its sustained bandwidth evenly; a core's DMA
  engine never exceeds ``dma_bytes_per_cycle``.
* Kernel time = launch overhead + the slowest core.

Deterministic: pure arithmetic on the program and the config.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch

from torch_spyre.hardware import HardwareConfig
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
)
from torch_spyre.ir import vector_ops as ops_mod
from torch_spyre.layout import SpyreTensorLayout, ceil_div
from torch_spyre.sim.step_costs import (
    _causal_fraction,
    _CoreView,
    _Cost,
    _dram_bytes,
    _step_cost,
    _Steps,
    _transfers,
)

UNITS = ("dma", "pe", "vector", "ring")


@dataclass(frozen=True)
class KernelReport:
    name: str
    time_s: float
    cycles: int
    cores_used: int
    #: per unit, busy seconds of each used core (core id order)
    busy_s: dict[str, tuple[float, ...]]
    #: per core, seconds from kernel start (after launch) to that core's end
    core_time_s: tuple[float, ...]
    #: mean over used cores of compute busy (max of PE, vector) / kernel time
    utilisation: float
    dram_bytes: int
    #: bytes the kernel must move at least: every operand once
    compulsory_bytes: int
    ring_bytes: int
    flops: float
    vector_ops: float
    bottleneck: str
    roofline_time_s: float
    attainment: float
    launch_s: float
    dtype: str = "float16"
    extra: dict[str, float] = field(default_factory=dict)
    #: the planner's choices (``plan_text``): core grid, tiles, k split
    plan: str = ""
    #: the floor on this card as calibrated: every operand moved once at the
    #: sustained bandwidth (``HardwareConfig.sustained_bandwidth_Bps``), or the
    #: PE / vector peak, whichever is longer (the roofline uses the peak
    #: bandwidth, which no DMA stream sustains)
    sustained_roof_s: float = 0.0

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / max(self.compulsory_bytes, 1)

    def summary(self) -> str:
        return (
            f"{self.name}: {self.time_s * 1e6:.2f} us ({self.cycles} cycles) on "
            f"{self.cores_used} cores, {self.bottleneck}-bound, util {self.utilisation:.0%}, "
            f"roofline {self.roofline_time_s * 1e6:.2f} us (attainment {self.attainment:.0%}), "
            f"{self.dram_bytes / 1e6:.3f} MB device memory, {self.flops / 1e9:.3f} GFLOP"
        )


def _matmul_flops(p: Program, s: Matmul) -> float:
    """The matmul's FLOPs the kernel must do: over every (i, j) of a causal
    dim pair (``Dim.causal_to``) only those with j <= i (the rest are masked
    and need no work; the roof of a causal attention is half a square's)."""
    a, b, o = (p.buffer(x) for x in (s.a, s.b, s.out))
    dims = set(a.dims) | set(b.dims) | set(o.dims)
    flops = 2.0 * math.prod(p.dim(d).size for d in dims)
    for d in dims:
        q = p.dim(d).causal_to
        if q is not None and q in dims:
            nq, nk = p.dim(q).size, p.dim(d).size
            pairs = sum(min(i + 1, nk) for i in range(nq))
            flops *= pairs / (nq * nk)
    return flops


# ----------------------------------------------------------------- model
def _cores(p: Program, sticky: tuple[str, ...] | None) -> tuple[list[int], list[dict[str, int]]]:
    """Every core's class (cores of one class cost the same) and the grid
    coordinates of the first core of each class, in core-id order.

    A core's cost depends on its extents, where its range starts inside a
    stick along the stick dims of the operands (``_sticky_dims``; all starts
    when causal tiles are skipped) and whether it stores replicated results
    (coordinate 0 of the split dims): a key per coordinate of each split dim.
    """
    grid = p.grid
    keys = []
    for d in grid:
        ce = d.core_extent
        per = []
        for c in range(d.cores):
            if sticky is None:
                start = c * ce
            else:  # every stick holds 128 / itemsize elements, which divides 128
                start = (c * ce) % 128 if d.name in sticky else 0
            per.append((max(0, min(d.size - c * ce, ce)), start, c == 0))
        keys.append(per)
    cls: list[int] = []
    first: dict[tuple, int] = {}
    coords: list[dict[str, int]] = []
    names = [d.name for d in grid]
    base = {d.name: 0 for d in p.dims}
    # core ids are row-major over the grid, the first split dim slowest
    for at in itertools.product(*(range(d.cores) for d in grid)):
        sig = tuple(keys[g][c] for g, c in enumerate(at))
        k = first.get(sig)
        if k is None:
            k = first[sig] = len(coords)
            coords.append({**base, **dict(zip(names, at))})
        cls.append(k)
    return cls, coords


#: reports by program structure: a model's layers repeat the same programs
#: under other names, and compilers ask for the same candidates again
_REPORTS: dict[tuple, KernelReport] = {}


def compulsory_bytes(p: Program) -> int:
    """The bytes a program must move at least: every operand once, or for an
    operand it only reads or writes in sub-blocks (``offsets`` and dims of its
    own smaller than the operand's: one timestep of a sequence, some rows of
    a cache), those blocks.  A block's share of the operand is taken in whole
    sticks along the stick dim, so an operand read whole counts its padded
    size, as before."""
    total = 0
    for o in p.operands:
        host = o.layout.host_size
        nbytes = o.layout.nbytes
        access = [s for s in p.steps if isinstance(s, (Load, Store)) and s.operand == o.name]
        if (
            not access
            or not host
            or any(s.rows is not None for s in access)
            or o.layout != SpyreTensorLayout.default(host, o.layout.dtype)
        ):
            total += nbytes
            continue
        se = o.layout.stick_elems
        blocks = set()
        for s in access:
            ext = tuple(1 if d is None else p.dim(d).size for d in s.index)
            blocks.add((tuple(s.offsets) or (0,) * len(ext), ext))
        share = 0.0
        for _, ext in blocks:
            f = 1.0
            for i, (e, h) in enumerate(zip(ext, host)):
                if i == len(host) - 1:
                    f *= min(1.0, ceil_div(e, se) / max(1, ceil_div(h, se)))
                else:
                    f *= min(1.0, e / max(1, h))
            share += f
        total += min(nbytes, int(round(nbytes * share)))
    return total


def estimate(program: Program, config: HardwareConfig | None = None) -> KernelReport:
    """Model one run of ``program`` on ``config`` (default: the card)."""
    cfg = config or HardwareConfig()
    p = program
    key = (p.dims, p.operands, p.buffers, p.steps, p.loop_order, cfg)
    rep = _REPORTS.get(key)
    if rep is None:
        if len(_REPORTS) > 8192:
            _REPORTS.clear()
        rep = _REPORTS[key] = _estimate(program, cfg)
    # fresh dicts: a caller may annotate its copy
    return replace(rep, name=program.name, busy_s=dict(rep.busy_s), extra=dict(rep.extra))


def _estimate(program: Program, cfg: HardwareConfig) -> KernelReport:
    p = program
    ncores = program.cores_used
    clock = cfg.clock_hz
    st = _Steps(p, cfg)
    # cores with the same extents, stick alignment and replica role cost the
    # same: each class of cores is modelled once (compile time: the cost model
    # is asked about thousands of candidate plans)
    cls, class_coords = _cores(p, _sticky_dims(p))
    views = [_CoreView(p, coords, cfg.stick_bytes) for coords in class_coords]
    transfers = [_transfers(p, cv, st) for cv in views]
    mem_cycles_per_byte = _shared_memory_rates(p, cls, views, transfers, st, cfg)
    n_iter_inner = None
    busy = {u: [0.0] * ncores for u in UNITS}
    core_cycles = [0.0] * ncores
    overhead = [0.0] * ncores
    dram_bytes = ring_bytes = 0.0
    vector_ops = sum(_vector_ops(p, s) for s in p.steps)
    per_sig: dict[tuple, tuple] = {}
    for c in range(ncores):
        k = cls[c]
        sig = (k, mem_cycles_per_byte[c])
        hit = per_sig.get(sig)
        if hit is not None:
            c_busy, c_over, c_dram, c_ring, core_cycles[c], n_iter = hit
            for unit in UNITS:
                busy[unit][c] = c_busy[unit]
            overhead[c] = c_over
            dram_bytes += c_dram
            ring_bytes += c_ring
            if c == 0:
                n_iter_inner = n_iter
            continue
        cv = views[k]
        moved = transfers[k]
        dram0, ring0 = dram_bytes, ring_bytes
        phase_b = {ph: dict.fromkeys(UNITS, 0.0) for ph in st.phase_loops}
        serial = 0.0
        for i, s in enumerate(p.steps):
            cost = _step_cost(cv, s, cfg, mem_cycles_per_byte[c], st.info[i], moved[i])
            if i in st.shared_pages:  # its pages move with an earlier transfer's descriptors
                cost.cycles["dma"] -= cost.setup
                cost.setup = 0.0
            frac = _causal_fraction(cv, s.loops, st.causal)
            if frac != 1.0:  # causal tiles skipped (Dim.causal_to)
                cost = _Cost(
                    {u: x * frac for u, x in cost.cycles.items()},
                    cost.setup * frac,
                    cost.dram_bytes * frac,
                    cost.ring_bytes * frac,
                )
            into = phase_b[st.phase[i]] if st.overlaps[i] else None
            for unit, cyc in cost.cycles.items():
                busy[unit][c] += cyc
                if into is not None:
                    into[unit] += cyc
                else:
                    serial += cyc
            overhead[c] += cost.setup
            dram_bytes += cost.dram_bytes
            ring_bytes += cost.ring_bytes
        core_cycles[c] = serial
        for ph, loops in st.phase_loops.items():
            # a pipeline of ``n_iter`` iterations: its busiest unit's cycles,
            # plus the others' share of one iteration (fill and drain)
            n_iter = max(1, cv.instances(loops)) if loops else 1
            n_iter = max(1, round(n_iter * _causal_fraction(cv, loops, st.causal)))
            if c == 0 and ph == max(st.phase_loops):
                n_iter_inner = n_iter
            loop_b = phase_b[ph]
            total_b = sum(loop_b.values())
            peak = max(loop_b.values())
            core_cycles[c] += peak + (total_b - peak) / n_iter
        per_sig[sig] = (
            {u: busy[u][c] for u in UNITS},
            overhead[c],
            dram_bytes - dram0,
            ring_bytes - ring0,
            core_cycles[c],
            n_iter,
        )
    launch_cycles = cfg.launch_overhead_s * clock
    slowest = max(range(ncores), key=lambda i: core_cycles[i])
    cycles = launch_cycles + core_cycles[slowest]
    time_s = cycles / clock
    # what dominates on the slowest core
    b = {u: busy[u][slowest] for u in UNITS}
    parts = {
        "compute": max(b["pe"], b["vector"]),
        "memory": b["dma"] - overhead[slowest],
        "ring": b["ring"],
    }
    parts["overhead"] = cycles - max(parts.values())
    bottleneck = max(parts, key=lambda k: parts[k])
    flops = sum(_matmul_flops(p, s) for s in p.steps if isinstance(s, Matmul))
    mm = next((s for s in p.steps if isinstance(s, Matmul)), None)
    mm_dtype = p.buffer(mm.a).dtype if mm is not None else torch.float16
    mm_b_dtype = p.buffer(mm.b).dtype if mm is not None else None
    compulsory = compulsory_bytes(p)
    roof = max(
        compulsory / cfg.memory_bandwidth_Bps,
        flops / cfg.peak_flops(mm_dtype, b_dtype=mm_b_dtype),
        vector_ops / cfg.peak_vector_ops(),
    )
    util = sum(max(busy["pe"][i], busy["vector"][i]) for i in range(ncores)) / ncores / cycles
    return KernelReport(
        name=program.name,
        time_s=time_s,
        cycles=int(round(cycles)),
        cores_used=ncores,
        busy_s={u: tuple(x / clock for x in busy[u]) for u in UNITS},
        core_time_s=tuple(x / clock for x in core_cycles),
        utilisation=util,
        dram_bytes=int(round(dram_bytes)),
        compulsory_bytes=compulsory,
        ring_bytes=int(round(ring_bytes)),
        flops=flops,
        vector_ops=vector_ops,
        bottleneck=bottleneck,
        roofline_time_s=roof,
        attainment=roof / time_s,
        launch_s=cfg.launch_overhead_s,
        dtype=str(mm_dtype).removeprefix("torch."),
        extra={"pipelined": float(st.pipelined), "inner_iterations": float(n_iter_inner or 1)},
        plan=plan_text(p, st.pipelined),
        sustained_roof_s=max(roof, compulsory / cfg.sustained_bandwidth_Bps),
    )


def plan_text(p: Program, pipelined: bool | None = None) -> str:
    """The planner's choices of ``p`` in one line: each dim as
    ``name=size``, ``/N`` when split over N cores, ``:T`` when walked in
    tiles of T on a core; ``k over cores`` when a matmul's contraction is
    split (a ring all-reduce of the partial sums); ``pipelined`` when the
    loop body overlaps its transfers with compute (double buffered)."""
    dims = []
    for d in p.dims:
        t = f"{d.name}={d.size}"
        if d.cores > 1:
            t += f"/{d.cores}"
        if d.tile_size < d.core_extent:
            t += f":{d.tile_size}"
        dims.append(t)
    cores = math.prod(d.cores for d in p.dims)
    out = f"{cores} cores [{' '.join(dims)}]"
    if any(isinstance(s, RingAllReduce) for s in p.steps):
        out += ", k over cores"
    if pipelined:
        out += ", pipelined"
    return out


def _vector_ops(p: Program, s: Step) -> float:
    """Operations the vector units do for ``s`` on the whole card (for rooflines)."""
    if isinstance(s, Vector):
        return _elements(p, p.buffer(s.out).dims) * ops_mod.vector_op(s.op).flops
    if isinstance(s, Reduce):
        return _elements(p, p.buffer(s.input).dims)
    if isinstance(s, Scan):
        return _elements(p, p.buffer(s.out).dims) * (2 if s.op == "linrec" else 1)
    return 0.0


def _sticky_dims(p: Program) -> tuple[str, ...] | None:
    """The dims whose start position matters to a core's cost: the stick dims
    of the operands (None: all of them, when causal tiles are skipped)."""
    if any(getattr(d, "causal_to", None) for d in p.dims):
        return None
    sticky = set()
    for s in p.steps:
        if isinstance(s, Load | Store):
            lay = p.operand(s.operand).layout
            if lay.host_size and s.index[lay.stick_dim] is not None:
                sticky.add(s.index[lay.stick_dim])
    return tuple(sorted(sticky))


def _shared_memory_rates(
    p: Program,
    cls: list[int],
    views: list[_CoreView],
    transfers: list[list],
    st: _Steps,
    cfg: HardwareConfig,
) -> list[float]:
    """Cycles per byte each core's DMA gets from the shared LPDDR5.

    Max-min fair sharing (water filling): all cores stream from the start;
    the sustained bandwidth is split evenly among the cores still moving
    data, each capped by its DMA engine.  A core with more bytes than the
    others (e.g. the one storing a reduced result) speeds up once the others
    are done.  Returns total cycles / total bytes of each core.
    """
    # cores of one class move the same bytes
    per_class = [_dram_bytes(p, cv, st, t) for cv, t in zip(views, transfers)]
    per_core = [per_class[k] for k in cls]
    port = float(cfg.dma_bytes_per_cycle)
    shared = cfg.sustained_bandwidth_Bps / cfg.clock_hz
    order = sorted(range(len(per_core)), key=lambda i: per_core[i])
    finish = [0.0] * len(per_core)
    t = moved = 0.0
    for rank, i in enumerate(order):
        rate = min(port, shared / (len(order) - rank))
        t += (per_core[i] - moved) / rate
        moved = per_core[i]
        finish[i] = t
    # cores with no bytes still get a rate (their transfers are empty)
    fair = max(1.0 / port, len(per_core) / shared)
    return [finish[i] / per_core[i] if per_core[i] else fair for i in range(len(per_core))]


def _elements(p: Program, dims: tuple[str, ...]) -> float:
    return float(math.prod(p.dim(d).size for d in dims))
