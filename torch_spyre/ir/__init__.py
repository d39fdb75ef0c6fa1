"""The program IR: the contract between the producers of kernel programs
(``kernels``, ``ops``, ``compiler``) and the runtime and simulated card.

A ``Program`` is one serialisable SPMD dataflow kernel: dims split over cores
and tiled, operands in device memory with their stick layouts, LX buffers,
and steps (stick loads and stores, PE-array matmuls, vector ops, reductions,
scans, ring transfers) in a loop nest.  ``GroupedProgram`` is several of them
in one launch.  ``vector_ops`` is the vocabulary of compute steps; the
``constants`` module the tables a program may take as constant operands.

Depends on torch, ``layout`` and ``hardware`` only; nothing here imports a
producer or the card.
"""

from torch_spyre.ir.grouped import (
    GroupedProgram,
    blocks_clash,
    rebase,
    scale_rows_before_store,
    touched_blocks,
)
from torch_spyre.ir.program import Program
from torch_spyre.ir.steps import (
    SCANS,
    Buffer,
    Dim,
    Load,
    LXOverflowError,
    Matmul,
    Operand,
    ProgramError,
    Reduce,
    RingAllReduce,
    Scan,
    SpanError,
    Step,
    Store,
    Vector,
    sole_load,
    step_reads,
    step_writes,
    transfer_dims,
)
from torch_spyre.ir.vector_ops import register_op, register_reduction

__all__ = [
    "SCANS",
    "Buffer",
    "Dim",
    "GroupedProgram",
    "LXOverflowError",
    "Load",
    "Matmul",
    "Operand",
    "Program",
    "ProgramError",
    "Reduce",
    "RingAllReduce",
    "Scan",
    "SpanError",
    "Step",
    "Store",
    "Vector",
    "rebase",
    "blocks_clash",
    "touched_blocks",
    "register_op",
    "register_reduction",
    "scale_rows_before_store",
    "sole_load",
    "step_reads",
    "step_writes",
    "transfer_dims",
]
