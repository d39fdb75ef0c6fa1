"""Grouped kernels: one launch whose cores run several phases one after another.

A mixture-of-experts layer multiplies each expert's tokens by that expert's
weights: as many matmuls as there are active experts, each of a different
height (the tokens the router sent it), all in one kernel.  The program IR
describes one loop nest over fixed dims; a ``GroupedProgram`` is a sequence
of such programs (*phases*) launched once: the cores run phase 0 on all their
cores, then phase 1, ... (the phases write disjoint sub-blocks of the outputs,
``Store.offsets``).  This is what a grouped GEMM does on the card: the host
knows the per-expert token counts (it read them back to size the phases, as
every grouped-GEMM launcher does) and the cores walk the experts in turn.

Timing: one launch overhead plus each phase's modelled time without its own
launch (``timing.estimate`` of the phase).  Phases do not overlap (no
prefetch of the next expert's weights during the current one's compute): a
small pessimism on short phases, stated here.  An expert that received no
token has no phase (its weights are never read); an expert with many tokens
has a long phase: the modelled time says what imbalance costs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_spyre.sim.config import HardwareConfig
from torch_spyre.sim.program import Load, Matmul, Operand, Program, ProgramError, Store, Vector
from torch_spyre.sim.timing import UNITS, KernelReport, estimate


@dataclass(frozen=True)
class GroupedProgram:
    name: str
    phases: tuple[Program, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def operands(self) -> tuple[Operand, ...]:
        """Every operand once (phases name the same device tensors alike)."""
        seen: dict[str, Operand] = {}
        for p in self.phases:
            for o in p.operands:
                seen.setdefault(o.name, o)
        return tuple(seen.values())

    @property
    def cores_used(self) -> int:
        return max((p.cores_used for p in self.phases), default=1)

    def validate(self, config: HardwareConfig | None = None) -> GroupedProgram:
        if not self.phases:
            raise ProgramError(f"grouped kernel {self.name!r} has no phase")
        first: dict[str, Operand] = {}
        for i, p in enumerate(self.phases):
            p.validate(config)
            for o in p.operands:
                o0 = first.setdefault(o.name, o)
                if o0.layout != o.layout:
                    raise ProgramError(
                        f"grouped kernel {self.name!r}, phase {i}: operand {o.name!r} has layout "
                        f"{o.layout}, an earlier phase {o0.layout}: the phases must bind the "
                        "same device tensors"
                    )
        return self

    def dump(self) -> str:
        head = f"grouped kernel {self.name}: {len(self.phases)} phases, one launch"
        return "\n".join([head] + [f"phase {i}:\n{p.dump()}" for i, p in enumerate(self.phases)])

    def __str__(self) -> str:
        return self.dump()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "grouped": [p.to_dict() for p in self.phases],
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GroupedProgram:
        return GroupedProgram(
            d["name"],
            tuple(Program.from_dict(p) for p in d["grouped"]),
            dict(d.get("meta", {})),
        )


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
    ncores = max(r.cores_used for r in reps)
    body = [r.time_s - r.launch_s for r in reps]
    time_s = launch + sum(body)
    busy = {u: [0.0] * ncores for u in UNITS}
    core_t = [0.0] * ncores
    for r in reps:
        for u in UNITS:
            for c, x in enumerate(r.busy_s[u]):
                busy[u][c] += x
        # a core idle in a phase waits for the phase's slowest core
        for c in range(ncores):
            core_t[c] += r.time_s - r.launch_s
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
        extra={"phases": float(len(reps)), "phase_time_s": float(sum(body))},
    )


def rebase(
    program: Program,
    operand: str,
    layout,
    *,
    lead: tuple[int, ...] = (),
    offsets: tuple[int, ...] = (),
    perm: tuple[int, ...] | None = None,
    rename: str | None = None,
) -> Program:
    """``program`` with ``operand`` bound to a larger tensor of ``layout``.

    The template reads (or writes) a tensor of host size ``h``; the real
    operand holds it as a sub-block: ``lead`` leading host dims indexed at
    fixed positions (an expert's weight ``W[e]`` of ``W [E, N, K]``: lead
    ``(e,)``) and ``offsets`` along the template's own dims (an expert's rows
    of the grouped activations: ``(row0, 0)``).  ``perm``: the real
    operand's trailing dims are the template's in this order (a weight stored
    [N, K] for a template reading [K, N]: ``(1, 0)``).  Every load and store
    of the operand gets the extra ``None`` index dims and the offsets;
    ``rename`` gives the operand another name (two templates reading one
    tensor).
    """
    old = program.operand(operand)
    name = rename or operand
    n_lead = len(lead)
    own = offsets or (0,) * len(old.layout.host_size)
    steps = []
    for s in program.steps:
        if isinstance(s, Load | Store) and s.operand == operand:
            prev = tuple(s.offsets) or (0,) * len(s.index)
            offs = tuple(a + b for a, b in zip(prev, own))
            index = tuple(s.index)
            if perm is not None:
                offs = tuple(offs[i] for i in perm)
                index = tuple(index[i] for i in perm)
            s = type(s)(
                **{
                    **s.__dict__,
                    "operand": name,
                    "index": (None,) * n_lead + index,
                    "offsets": tuple(lead) + offs,
                }
            )
        steps.append(s)
    ops = tuple(Operand(name, layout, o.role) if o.name == operand else o for o in program.operands)
    return Program(
        program.name,
        program.dims,
        ops,
        program.buffers,
        tuple(steps),
        program.loop_order,
        dict(program.meta),
    )


def scale_rows_before_store(
    program: Program, out: str, weights: str, rows: str, layout, row0: int
) -> Program:
    """Multiply each row of the value stored into ``out`` by a per-row weight:
    operand ``weights`` ([R, 1], one value per row of the grouped output),
    rows ``row0 ..`` of dim ``rows`` (a mixture-of-experts routing weight).
    The weight tile is loaded next to the store, in the store's loops."""
    from torch_spyre.sim.program import Buffer

    steps = list(program.steps)
    at = next(i for i, s in enumerate(steps) if isinstance(s, Store) and s.operand == out)
    st = steps[at]
    buf = program.buffer(st.buffer)
    wt = f"{weights}_t"
    new = [
        Load(wt, weights, (rows, None), st.loops, offsets=(row0, 0)),
        Vector("mul", st.buffer, (st.buffer, wt), (), st.loops),
    ]
    steps[at:at] = new
    return Program(
        program.name,
        program.dims,
        (*program.operands, Operand(weights, layout, "input")),
        (*program.buffers, Buffer(wt, (rows,), buf.dtype)),
        tuple(steps),
        program.loop_order,
        dict(program.meta),
    )
