"""Constant operands of a kernel program: tables the runtime makes, not graph tensors.

A compiled program may name operands whose values are fixed by their shape:
``iota`` (0, 1, 2, ... as fp32: index arithmetic on the vector units) and
``eye`` (a 0/1 lane-gather table, ``compiler/lanes.py``: a read that cuts
the stick dim into pieces narrower than a stick goes through the PE array).
The producer names them by role; the runtime builds them from this module,
once per kernel and card.
"""

from __future__ import annotations

import torch

#: operand roles the runtime fills with constant tables (not graph tensors)
CONST_ROLES = ("iota", "eye")


def iota(n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 as fp32 on the host."""
    return torch.arange(n, dtype=torch.float32)


def table_key(lanes: int, off: int, pieces: list[tuple[int, int]], dtype: torch.dtype) -> str:
    p = ",".join(f"{n}*{c}" for n, c in pieces)
    return f"eye:{lanes}:{off}:{p}:{str(dtype).removeprefix('torch.')}"


def table(lanes: int, off: int, pieces, dtype: torch.dtype) -> torch.Tensor:
    """``E[j, i_1, ..., i_r]`` = 1 where ``j == off + sum_k c_k i_k`` for pieces
    ``(n_k, c_k)`` (size, lane stride): [lanes, n_1, ..., n_r] on the host."""
    sizes = [n for n, _ in pieces]
    pos = torch.full(sizes, off, dtype=torch.int64) if sizes else torch.tensor(off)
    for k, (n, c) in enumerate(pieces):
        shape = [1] * len(sizes)
        shape[k] = n
        pos = pos + (torch.arange(n) * c).reshape(shape)
    out = torch.zeros(lanes, *sizes, dtype=dtype)
    out.reshape(lanes, -1)[pos.reshape(-1), torch.arange(pos.numel())] = 1
    return out
