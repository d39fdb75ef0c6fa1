"""A grouped program's phases in waves: the one packing, searched.

A grouped kernel (``ir/grouped.py``) runs its phases in turn, or, grouped in
waves, at once on disjoint cores.  ``in_waves`` builds one launch of stages
(a stage's phases are independent of one another and read what earlier
stages wrote) at each wave width the card allows and keeps the fastest, as
every kernel's plan is found (``kernels/search.py``).  Used by the LoRA
programs (``kernels/lora.py``); a mixture of experts' phases are each
memory-bound on every core, and waves gain them nothing.
"""

from __future__ import annotations

from dataclasses import replace

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import GroupedProgram, Program, blocks_clash, touched_blocks
from torch_spyre.sim.grouped import estimate_grouped


def in_waves(
    name: str, stages: list[list], cfg: HardwareConfig, distinct: tuple[str, ...] = ()
) -> GroupedProgram:
    """One launch of ``stages`` in order (a stage's phases are independent of
    one another and read what earlier stages wrote), its phases packed into
    waves (``ir.grouped``: phases at once on disjoint cores) as the search
    finds fastest: ``width`` phases at a time on ``cores // width`` cores
    each, width 1 being the phases in turn on every core.  A phase that
    clashes with one already in the wave (a block both touch, one writes)
    starts the next wave.  ``stages``: lists of ``phase(config) -> Program``;
    ``distinct``: row-table operands whose entries are distinct rows
    (``GroupedProgram.distinct``)."""
    from torch_spyre.kernels.search import search

    def build(width: int) -> GroupedProgram:
        sub = cfg if width == 1 else replace(cfg, cores=cfg.cores // width)
        phases: list[Program] = []
        waves: list[int] = []
        wave = -1
        for stage in stages:
            members: list = []
            for make in stage:
                p = make(sub)
                blocks = touched_blocks(p, distinct)
                if len(members) in (0, width) or any(blocks_clash(blocks, m) for m in members):
                    wave, members = wave + 1, []
                members.append(blocks)
                phases.append(p)
                waves.append(wave)
        return GroupedProgram(
            name, tuple(phases), waves=tuple(waves) if width > 1 else (), distinct=distinct
        )

    most = max(len(st) for st in stages)
    widths = [w for w in (1, 2, 4, 8, 16, 32) if w <= min(most, cfg.cores)]
    # every phase comes from a validated template, and the packing keeps each
    # wave within the cores and free of clashes: only the winner is checked
    found = search(
        widths, build, cfg, what=name, cost=lambda g: estimate_grouped(g, cfg).time_s,
        validate=False,
    )  # fmt: skip
    return found.result.validate(cfg)
