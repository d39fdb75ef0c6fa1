"""The values a ``lowering.ProgramBuilder`` computes with.

``Val`` is a value in an LX buffer, indexed by iteration variables; ``Scal``
a constant folded into the program.  Their own module so that the builder's
helpers (``compiler.trig``, ``compiler.matmuls``) take them without importing
the builder back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Val:
    """A value in an LX buffer, indexed by iteration variables."""

    buf: str
    dims: frozenset[str]
    dtype: torch.dtype


@dataclass(frozen=True)
class Scal:
    """A constant of a dtype."""

    value: float | int | bool
    dtype: torch.dtype
