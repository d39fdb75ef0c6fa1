"""The compiler's plan search for eager kernels (issue 18).

An eager op builds its program with a fixed recipe (``ops/programs.py``: the
default core split, no operand multicast); the compiler chooses among
candidate splits, tiles and multicast with the cost model
(``planner._plan_dims``).  ``plan`` runs that same search on an eager
program, so an eager ``a @ b`` is modelled as the compiler would run it
alone, not up to 7x slower.  Row kernels (layer / RMS norm) take the same
search: their rows spread over all cores (the recipe puts whole stat
sticks, 32 rows, on a core) and tiled so the row loop is a pipeline.  The
result is cached per program (the eager layer also caches the kernel per
shape), so the hot path plans once.

Only the dims' split, tiles and loops and the loads' multicast change: the
steps, buffers and operands are the eager program's, so the numbers it
computes are the same.
"""

from __future__ import annotations

from dataclasses import replace

from torch_spyre.compiler import kernel_plan, planner
from torch_spyre.sim import Load, Program, Reduce, Store
from torch_spyre.sim.config import HardwareConfig
from torch_spyre.sim.program import Scan

_plans: dict[tuple, Program] = {}


def _renamed(s, ren: dict[str, str]):
    def names(xs):
        return tuple(ren.get(x, x) if x is not None else None for x in xs)

    kw: dict = {"loops": names(s.loops)}
    if isinstance(s, Load | Store):
        kw["index"] = names(s.index)
    if isinstance(s, Reduce | Scan):
        kw["dim"] = ren[s.dim]
    return replace(s, **kw)


def plan(program: Program, cfg: HardwareConfig) -> Program:
    """``program`` with the compiler's choice of split, tiles and multicast;
    ``program`` itself when the search does not serve it (e.g. no plan fits)."""
    key = (program, cfg)
    hit = _plans.get(key)
    if hit is not None:
        return hit
    # the compiler names dims x0, x1, ... (outer to inner); the reduced ones
    # are those no store writes (a matmul's k) and those a row step walks
    # whole (a norm's or softmax's row: never split over cores)
    ren = {d.name: f"x{i}" for i, d in enumerate(program.dims)}
    stored = {d for s in program.steps if isinstance(s, Store) for d in s.index if d}
    rows = {s.dim for s in program.steps if isinstance(s, Reduce | Scan)}
    reduced = frozenset(ren[d.name] for d in program.dims if d.name not in stored or d.name in rows)
    steps = [_renamed(s, ren) for s in program.steps]
    buffers = {b.name: replace(b, dims=tuple(ren[d] for d in b.dims)) for b in program.buffers}
    sizes = {ren[d.name]: d.size for d in program.dims}
    try:
        planned = planner._plan_dims(
            program.name, steps, buffers, list(program.operands), sizes, reduced, cfg
        )
    except (kernel_plan.Unsupported, ValueError):
        planned = program
    if len(_plans) > 4096:
        _plans.clear()
    _plans[key] = planned
    return planned
