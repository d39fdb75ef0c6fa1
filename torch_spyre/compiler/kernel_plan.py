"""What lowering a fused group produces, and the error it raises when it cannot.

``Plan`` is one kernel program with the Inductor buffers behind its operands
(``OperandUse``: the wrapper variable, its role, the layout the program reads
or writes it in, and where a view starts), plus the buffers it keeps in LX,
a wrapper line to run after the launch and the restickify kernels to launch
first.  ``Unsupported`` (``kernels/search.py``, re-exported here) is raised
by the builder, the view decomposition and the planner for anything a kernel
program cannot express (the message names it); the scheduling catches it to
replan node by node.  Shared by ``compiler.lowering``, ``compiler.views``,
``compiler.layouts`` and the scheduling, so it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_spyre.ir import Program
from torch_spyre.kernels.search import Unsupported
from torch_spyre.layout import SpyreTensorLayout


@dataclass
class OperandUse:
    name: str  # program operand name
    buffer: str  # Inductor buffer name (the wrapper variable)
    role: str
    layout: SpyreTensorLayout
    shape: tuple[int, ...]  # the wrapper tensor's shape
    #: first device element of the view (a slice that is one block of sticks)
    start: int = 0
    #: per view host dim, where its loads start (a slice that is not one
    #: block of sticks reads the whole buffer from these offsets)
    load_offsets: tuple[int, ...] = ()


@dataclass
class Plan:
    program: Program
    operands: list[OperandUse]
    removed: set[str] = field(default_factory=set)
    #: a wrapper line to write after the launch (drops a fused matmul's inputs)
    after: str | None = None
    #: kernels to launch first: restickify plans writing an input operand in
    #: the layout this kernel reads it in (``compiler.layouts``)
    pre: list[Plan] = field(default_factory=list)


__all__ = ["OperandUse", "Plan", "Unsupported"]
