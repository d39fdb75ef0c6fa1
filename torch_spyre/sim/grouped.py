"""The modelled time of a grouped kernel (``ir/grouped.py``): one launch, the phases in turn.

A mixture-of-experts layer multiplies each expert's tokens by that expert's
weights: as many matmuls as there are active experts, each of a different
height (the tokens the router sent it), all in one kernel.  The program IR
describes one loop nest over fixed dims; a ``GroupedProgram`` is a sequence
of such programs (*phases*) launched once: the cores run phase 0 on all their
cores, then phase 1, ... (the phases write disjoint sub-blocks of the outputs,
``Store.offsets``).  This is what a grouped GEMM does on the card: the host
knows the per-expert token counts (it read them back to size the phases, as
every grouped-GEMM launcher does) and the cores walk the experts in turn.

Timing: one launch overhead plus each wave's modelled time; a wave of one
phase takes that phase's time without its own launch (``timing.estimate`` of
the phase).  Phases of a wave run at once on their own cores: the wave takes
its slowest phase's time, or its phases' device-memory bytes at the
sustained bandwidth they share, whichever is longer (each phase alone is
timed with all of the bandwidth; together they cannot move more than the
card sustains).  Waves do not overlap (no prefetch of the next expert's
weights during the current one's compute): a small pessimism on short
phases, stated here.  An expert that received no
token has no phase (its weights are never read); an expert with many tokens
has a long phase: the modelled time says what imbalance costs.
"""

from __future__ import annotations

import math

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import GroupedProgram, Load, Matmul, Program, Store
from torch_spyre.sim.timing import UNITS, KernelReport, estimate


def _block_bytes(p: Program) -> float:
    """Bytes of the distinct sub-blocks the phase's loads and stores touch
    (whole sticks along the stick dim): what it must move at least once."""
    seen: set[tuple] = set()
    total = 0.0
    for s in p.steps:
        if not isinstance(s, Load | Store):
            continue
        lay = p.operand(s.operand).layout
        key = (s.operand, s.index, tuple(s.offsets))
        if key in seen:
            continue
        seen.add(key)
        sizes = [1 if d is None else p.dim(d).size for d in s.index]
        if lay.host_size:
            k = lay.stick_dim
            sizes[k] = math.ceil(sizes[k] / lay.stick_elems) * lay.stick_elems
        total += math.prod(sizes) * lay.itemsize
    return total


def estimate_grouped(gp: GroupedProgram, config: HardwareConfig | None = None) -> KernelReport:
    """One launch, then the phases in order (see the module docstring)."""
    cfg = config or HardwareConfig()
    reps = [estimate(p, cfg) for p in gp.phases]
    launch = cfg.launch_overhead_s
    waves = gp.wave_phases()
    ncores = max(sum(reps[i].cores_used for i in w) for w in waves)
    body = []
    busy = {u: [0.0] * ncores for u in UNITS}
    core_t = [0.0] * ncores
    for w in waves:
        wave_s = max(
            max(reps[i].time_s - reps[i].launch_s for i in w),
            sum(reps[i].dram_bytes for i in w) / cfg.sustained_bandwidth_Bps if len(w) > 1 else 0.0,
        )
        body.append(wave_s)
        base = 0
        for i in w:
            for u in UNITS:
                for c, x in enumerate(reps[i].busy_s[u]):
                    busy[u][base + c] += x
            base += reps[i].cores_used
        # a core idle in a wave waits for the wave's slowest phase
        for c in range(ncores):
            core_t[c] += wave_s
    time_s = launch + sum(body)
    flops = sum(r.flops for r in reps)
    vector_ops = sum(r.vector_ops for r in reps)
    compulsory = int(sum(_block_bytes(p) for p in gp.phases))
    mm_dtype = next(
        (p.buffer(s.a).dtype for p in gp.phases for s in p.steps if isinstance(s, Matmul)),
        torch.float16,
    )
    roof = max(
        compulsory / cfg.memory_bandwidth_Bps,
        flops / cfg.peak_flops(mm_dtype),
        vector_ops / cfg.peak_vector_ops(),
    )
    slowest = max(range(ncores), key=lambda c: sum(busy[u][c] for u in UNITS))
    parts = {
        "compute": max(busy["pe"][slowest], busy["vector"][slowest]),
        "memory": busy["dma"][slowest],
        "ring": busy["ring"][slowest],
    }
    parts["overhead"] = time_s - max(parts.values())
    util = sum(max(busy["pe"][c], busy["vector"][c]) for c in range(ncores)) / ncores / time_s
    return KernelReport(
        name=gp.name,
        time_s=time_s,
        cycles=int(round(time_s * cfg.clock_hz)),
        cores_used=ncores,
        busy_s={u: tuple(v) for u, v in busy.items()},
        core_time_s=tuple(core_t),
        utilisation=util,
        dram_bytes=sum(r.dram_bytes for r in reps),
        compulsory_bytes=compulsory,
        ring_bytes=sum(r.ring_bytes for r in reps),
        flops=flops,
        vector_ops=vector_ops,
        bottleneck=max(parts, key=lambda k: parts[k]),
        roofline_time_s=roof,
        attainment=roof / time_s,
        launch_s=launch,
        dtype=str(mm_dtype).removeprefix("torch."),
        extra={
            "phases": float(len(reps)),
            "waves": float(len(waves)),
            "phase_time_s": float(sum(body)),
        },
        plan=" | ".join(dict.fromkeys(r.plan for r in reps)),
        sustained_roof_s=max(roof, compulsory / cfg.sustained_bandwidth_Bps),
    )
