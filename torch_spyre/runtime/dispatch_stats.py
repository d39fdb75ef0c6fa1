"""How each aten op on spyre was served: device kernel, adapter or host fallback.

Producers record one event per op call; the coverage tool and the profiler
read the counts.  Paths: "kernel" (a kernel program on the card), "adapter"
(rewritten into supported ops), "fallback" (ran on the host), and "degraded"
(a node of a compiled graph the compiler could not plan, run as eager ops:
compiler/degrade.py; its ops are counted under their own paths too).  Calls served
by the C++ warm launch path (csrc/warm.cpp) are counted there, under the
name the Python path records for them, and folded in here on every read.
"""

from __future__ import annotations

from collections import Counter

from torch_spyre import _C

PATHS = ("kernel", "adapter", "fallback", "degraded")
_counts: Counter[tuple[str, str]] = Counter()


def record(path: str, op: str) -> None:
    _counts[(path, op)] += 1


def _fold() -> None:
    for op, n in _C._warm_counts():  # always device kernels
        _counts[("kernel", op)] += n


def counts(path: str | None = None) -> dict[tuple[str, str], int] | dict[str, int]:
    """All counts keyed by (path, op), or those of one path keyed by op."""
    _fold()
    if path is None:
        return dict(_counts)
    return {op: n for (p, op), n in _counts.items() if p == path}


def reset(path: str | None = None) -> None:
    _fold()
    if path is None:
        _counts.clear()
        return
    for key in [k for k in _counts if k[0] == path]:
        del _counts[key]
