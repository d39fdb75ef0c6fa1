"""The simulated Spyre card: hardware config, kernel programs, executor, timing.

Self-contained: depends on torch and ``torch_spyre.layout`` only, never on
the runtime, so a real-card runtime can replace it behind the same calls.
"""

from torch_spyre.sim import trace
from torch_spyre.sim.card import (
    CardStats,
    SimulatedCard,
    get_card,
    reset_cards,
    timing_only,
    timing_only_active,
)
from torch_spyre.sim.config import HardwareConfig, HardwareConfigError, parse_size
from torch_spyre.sim.executor import execute
from torch_spyre.sim.grouped import GroupedProgram, estimate_grouped
from torch_spyre.sim.ops import register_op, register_reduction
from torch_spyre.sim.program import (
    Buffer,
    Dim,
    Load,
    LXOverflowError,
    Matmul,
    Operand,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    SpanError,
    Store,
    Vector,
)
from torch_spyre.sim.timing import KernelReport, estimate
from torch_spyre.sim.trace import KernelRecord, TransferRecord

__all__ = [
    "Buffer",
    "CardStats",
    "Dim",
    "GroupedProgram",
    "HardwareConfig",
    "HardwareConfigError",
    "KernelRecord",
    "KernelReport",
    "LXOverflowError",
    "Load",
    "Matmul",
    "Operand",
    "Program",
    "ProgramError",
    "Reduce",
    "RingAllReduce",
    "SimulatedCard",
    "SpanError",
    "Store",
    "TransferRecord",
    "Vector",
    "estimate",
    "estimate_grouped",
    "execute",
    "get_card",
    "parse_size",
    "register_op",
    "register_reduction",
    "reset_cards",
    "timing_only",
    "timing_only_active",
    "trace",
]
