"""How each aten op on spyre was served: device kernel, adapter or host fallback.

Producers record one event per op call; the coverage tool and the profiler
read the counts.  Paths: "kernel" (a kernel program on the card), "adapter"
(rewritten into supported ops), "fallback" (ran on the host).
"""

from __future__ import annotations

from collections import Counter

PATHS = ("kernel", "adapter", "fallback")
_counts: Counter[tuple[str, str]] = Counter()


def record(path: str, op: str) -> None:
    _counts[(path, op)] += 1


def counts(path: str | None = None) -> dict[tuple[str, str], int] | dict[str, int]:
    """All counts keyed by (path, op), or those of one path keyed by op."""
    if path is None:
        return dict(_counts)
    return {op: n for (p, op), n in _counts.items() if p == path}


def reset(path: str | None = None) -> None:
    if path is None:
        _counts.clear()
        return
    for key in [k for k in _counts if k[0] == path]:
        del _counts[key]
