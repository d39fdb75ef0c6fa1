"""Planning options of the spyre compiler (for benchmarks and design studies).

``planning(naive=True)`` makes the compiler plan what a straightforward
backend would: every Inductor node its own kernel (no fusion, so every
intermediate goes through device memory), a matmul never absorbs its
epilogue, matmul rows split over the cores with no operand reuse between
cores (no ring multicast: every core streams the whole weight) and no cost
model consulted.  ``planning(fusion=False)`` keeps the optimised plans but
fuses nothing (one kernel per node, matmul epilogues apart).
``planning(cores=1)`` plans for that many cores of the card;
``planning(lx_bytes=64 * 1024)`` plans as if each core had that much LX
(a design study, or a test of rows longer than the LX at small sizes).

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
    #: plan for at most this many LX bytes per core (None: the card's)
    lx_bytes: int | None = None

    @property
    def fuse(self) -> bool:
        return self.fusion and not self.naive

    def key(self) -> str:
        key = f"naive={int(self.naive)},cores={self.cores or 0},fusion={int(self.fusion)}"
        return key + (f",lx={self.lx_bytes}" if self.lx_bytes else "")


_current = PlanningOptions()


def current() -> PlanningOptions:
    return _current


def configure(**changes) -> PlanningOptions:
    """Change the process-wide planning options (``planning()`` for a scope)."""
    global _current
    from dataclasses import replace

    if changes.get("cores") is not None and changes["cores"] < 1:
        raise ValueError(f"configure(cores=...) needs at least one core, got {changes['cores']}")
    _current = replace(_current, **changes)
    return _current


@contextlib.contextmanager
def planning(
    naive: bool = False, cores: int | None = None, fusion: bool = True, lx_bytes: int | None = None
) -> Iterator[PlanningOptions]:
    """Plan the graphs compiled inside with these options (process-wide)."""
    global _current
    if cores is not None and cores < 1:
        raise ValueError(f"planning(cores=...) needs at least one core, got {cores}")
    if lx_bytes is not None and lx_bytes < 4096:
        raise ValueError(f"planning(lx_bytes=...) needs at least 4096 bytes, got {lx_bytes}")
    old, _current = _current, PlanningOptions(naive, cores, fusion, lx_bytes)
    try:
        yield _current
    finally:
        _current = old


def planning_config(config):
    """The card's ``HardwareConfig`` as the planner should see it."""
    cores, lx = _current.cores, _current.lx_bytes
    if cores is not None and cores < config.cores:
        config = config.replace(cores=cores)
    if lx is not None and lx < config.lx_bytes:
        config = config.replace(lx_bytes=lx)
    return config
