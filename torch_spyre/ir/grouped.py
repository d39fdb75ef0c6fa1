"""Grouped kernels: one launch whose cores run several phases one after another.

A mixture-of-experts layer multiplies each expert's tokens by that expert's
weights: as many matmuls as there are active experts, each of a different
height (the tokens the router sent it), all in one kernel.  The program IR
describes one loop nest over fixed dims; a ``GroupedProgram`` is a sequence
of such programs (*phases*) launched once: the cores run phase 0 on all their
cores, then phase 1, ... (the phases write disjoint sub-blocks of the outputs,
``Store.offsets``).  The timing of a grouped launch is ``sim/grouped.py``'s.

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
