"""Planning options of the spyre compiler (for benchmarks and design studies).

``planning(naive=True)`` makes the compiler plan what a straightforward
backend would: every Inductor node its own kernel (no fusion, so every
intermediate goes through device memory), a matmul never absorbs its
epilogue, matmul rows split over the cores with no operand reuse between
cores (no ring multicast: every core streams the whole weight) and no cost
model consulted.  ``planning(fusion=False)`` keeps the optimised plans but
fuses nothing (one kernel per node, matmul epilogues apart).
``planning(cores=1)`` plans for that many cores of the card.

The options are part of the FX graph cache key (``SpyreGraphPass.uuid``), so
a graph planned under one set of options is never replayed under another;
Dynamo's own cache is per function object, so compile a fresh function (or
``torch._dynamo.reset()``) after changing them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PlanningOptions:
    #: rows over cores, no operand reuse, no fusion, intermediates through memory
    naive: bool = False
    #: plan for at most this many cores (None: the card's)
    cores: int | None = None
    #: fuse nodes into one kernel and matmuls with their epilogues (naive: never)
    fusion: bool = True

    @property
    def fuse(self) -> bool:
        return self.fusion and not self.naive

    def key(self) -> str:
        return f"naive={int(self.naive)},cores={self.cores or 0},fusion={int(self.fusion)}"


_current = PlanningOptions()


def current() -> PlanningOptions:
    return _current


@contextlib.contextmanager
def planning(
    naive: bool = False, cores: int | None = None, fusion: bool = True
) -> Iterator[PlanningOptions]:
    """Plan the graphs compiled inside with these options (process-wide)."""
    global _current
    if cores is not None and cores < 1:
        raise ValueError(f"planning(cores=...) needs at least one core, got {cores}")
    old, _current = _current, PlanningOptions(naive, cores, fusion)
    try:
        yield _current
    finally:
        _current = old


def planning_config(config):
    """The card's ``HardwareConfig`` as the planner should see it."""
    cores = _current.cores
    if cores is not None and cores < config.cores:
        return config.replace(cores=cores)
    return config
