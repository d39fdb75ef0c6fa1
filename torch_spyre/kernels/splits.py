"""Core counts a planner tries for a dimension of whole sticks."""

from __future__ import annotations


def stick_splits(sticks: int, limit: int) -> list[int]:
    """Core counts to try for a dim of ``sticks`` whole sticks on at most
    ``limit`` cores: the powers of two, and the divisors of ``sticks`` (9
    sticks over 8 cores leave three idle with 2 sticks each; over 9 or 3 every
    core streams an equal share, which is what a decode projection of K or
    N = 576 needs to reach the memory roof).  Used by the matmul planner
    (``kernels.plan``) and the SwiGLU MLP's (``kernels.swiglu``)."""
    pows = {1 << i for i in range(limit.bit_length()) if 1 << i <= min(sticks, limit)}
    return sorted(pows | {d for d in range(3, min(sticks, limit) + 1) if sticks % d == 0})
