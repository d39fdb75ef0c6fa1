"""Grouped kernels: one launch whose cores run several phases one after another.

A mixture-of-experts layer multiplies each expert's tokens by that expert's
weights: as many matmuls as there are active experts, each of a different
height (the tokens the router sent it), all in one kernel.  The program IR
describes one loop nest over fixed dims; a ``GroupedProgram`` is a sequence
of such programs (*phases*) launched once: the cores run phase 0 on all their
cores, then phase 1, ... (the phases write disjoint sub-blocks of the outputs,
``Store.offsets``).  The timing of a grouped launch is ``sim/grouped.py``'s.

*Waves*: consecutive phases may run at once, each on its own cores (the
wave's first phase on cores 0.., the next on the cores after it: the card is
SPMD, a core's id picks its phase).  Phases of one wave must fit the card's
cores together and touch disjoint blocks of every operand one of them writes
(``validate`` checks both; a row gathered through a table may be any row,
unless the program says the table's entries are distinct rows).
Small phases (a LoRA adapter's 16-row shrink, a decode expert's few tokens)
are bound by fixed DMA latency, not by cores: a wave runs several in the
time of one.

``rebase`` binds a template program's operand to a sub-block of a larger
tensor (an expert's weight ``W[e]`` of ``W [E, N, K]``) and
``scale_rows_before_store`` multiplies the stored rows by per-row weights:
the two rewrites a grouped kernel's builder (``kernels/moe.py``) applies to
its per-expert templates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir.program import Buffer, Load, Operand, Program, ProgramError, Store, Vector


@dataclass(frozen=True)
class GroupedProgram:
    name: str
    phases: tuple[Program, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    #: each phase's wave (non-decreasing from 0; phases of one wave run at
    #: once on disjoint cores); () = every phase its own wave, in turn
    waves: tuple[int, ...] = ()
    #: operands holding row tables whose entries are distinct rows (a LoRA
    #: batch's tokens in slot order): phases addressing rows through disjoint
    #: entries of one touch disjoint rows
    distinct: tuple[str, ...] = ()

    def wave_phases(self) -> list[tuple[int, ...]]:
        """The phases (indices) of each wave, in order."""
        if not self.waves:
            return [(i,) for i in range(len(self.phases))]
        out: dict[int, list[int]] = {}
        for i, w in enumerate(self.waves):
            out.setdefault(w, []).append(i)
        return [tuple(v) for _, v in sorted(out.items())]

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
        self._validate_waves(config or HardwareConfig())
        return self

    def _validate_waves(self, cfg: HardwareConfig) -> None:
        if not self.waves:
            return
        w = self.waves
        if (
            len(w) != len(self.phases)
            or w[0] != 0
            or any(b - a not in (0, 1) for a, b in zip(w, w[1:]))
        ):
            raise ProgramError(
                f"grouped kernel {self.name!r}: waves {w} for {len(self.phases)} phases "
                "(one per phase, 0, then the same or the next number)"
            )
        for wave in self.wave_phases():
            cores = sum(self.phases[i].cores_used for i in wave)
            if cores > cfg.cores:
                raise ProgramError(
                    f"grouped kernel {self.name!r}: phases {list(wave)} run at once on "
                    f"{cores} cores, the card has {cfg.cores}"
                )
            blocks = [touched_blocks(self.phases[i], self.distinct) for i in wave]
            for x in range(len(wave)):
                for y in range(x + 1, len(wave)):
                    clash = blocks_clash(blocks[x], blocks[y])
                    if clash:
                        raise ProgramError(
                            f"grouped kernel {self.name!r}: phases {wave[x]} and {wave[y]} "
                            f"run at once but both touch a block of {clash!r} that one writes"
                        )

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
            **({"waves": list(self.waves)} if self.waves else {}),
            **({"distinct": list(self.distinct)} if self.distinct else {}),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GroupedProgram:
        return GroupedProgram(
            d["name"],
            tuple(Program.from_dict(p) for p in d["grouped"]),
            dict(d.get("meta", {})),
            tuple(d.get("waves", ())),
            tuple(d.get("distinct", ())),
        )


#: per operand: (writes it, the boxes it touches: per host dim (table, start,
#: end): rows start..end, or with a table, the rows its entries start..end name)
Blocks = dict[str, tuple[bool, list[tuple[tuple[str | None, int, int], ...]]]]


def touched_blocks(p: Program, distinct: tuple[str, ...] = ()) -> Blocks:
    """The blocks of each operand ``p`` loads or stores.  A dim addressed
    through a row table is all of the dim, unless the table's operand is in
    ``distinct`` (its entries name distinct rows): then it is the table's
    entries the phase reads, and two phases reading disjoint entries of it
    address disjoint rows."""
    out: Blocks = {}
    tables = {s.buffer: s for s in p.steps if isinstance(s, Load) and s.operand in distinct}
    for s in p.steps:
        if not isinstance(s, Load | Store):
            continue
        host = p.operand(s.operand).layout.host_size
        offs = tuple(s.offsets) or (0,) * len(s.index)
        box: list[tuple[str | None, int, int]] = []
        for i, d in enumerate(s.index):
            if s.rows is not None and i == s.rows_dim:
                t = tables.get(s.rows)
                if t is None:
                    box.append((None, 0, host[i]))
                else:
                    t0 = (tuple(t.offsets) or (0,))[0]
                    n = 1 if t.index[0] is None else p.dim(t.index[0]).size
                    box.append((t.operand, t0, t0 + n))
            else:
                n = 1 if d is None else p.dim(d).size
                box.append((None, offs[i], offs[i] + n))
        writes, boxes = out.get(s.operand, (False, []))
        out[s.operand] = (writes or isinstance(s, Store), [*boxes, tuple(box)])
    return out


def blocks_clash(a: Blocks, b: Blocks) -> str | None:
    """An operand both touch, one writes, in overlapping blocks (None: none).
    Rows named through a table and rows by position may be the same rows."""

    def overlap(x, y) -> bool:
        if x[0] != y[0]:
            return True
        return x[1] < y[2] and y[1] < x[2]

    for name in a.keys() & b.keys():
        (wa, ba), (wb, bb) = a[name], b[name]
        if not (wa or wb):
            continue
        for x in ba:
            for y in bb:
                if all(overlap(dx, dy) for dx, dy in zip(x, y)):
                    return name
    return None


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
