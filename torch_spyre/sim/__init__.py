"""The simulated Spyre card: the card model, the functional executor, the timing model.

``SimulatedCard`` validates, executes and times kernel programs (``ir``) and
models copies and collectives; ``execute`` runs a program on device memory
for real numbers; ``estimate`` gives its modelled cycles; ``trace`` is the
sink every modelled kernel and transfer goes to.  Depends on torch,
``layout``, ``hardware``, ``settings`` and ``ir`` only, never on the runtime
or the producers of programs, so a real-card runtime can replace it behind
the same calls.
"""

from torch_spyre.sim import trace
from torch_spyre.sim.card import (
    SimulatedCard,
    get_card,
    reset_cards,
    timing_only,
    timing_only_active,
)
from torch_spyre.sim.executor import execute
from torch_spyre.sim.grouped import estimate_grouped
from torch_spyre.sim.timing import KernelReport, estimate
from torch_spyre.sim.trace import KernelRecord, TransferRecord

__all__ = [
    "KernelRecord",
    "KernelReport",
    "SimulatedCard",
    "TransferRecord",
    "estimate",
    "estimate_grouped",
    "execute",
    "get_card",
    "reset_cards",
    "timing_only",
    "timing_only_active",
    "trace",
]
