"""The fuzzer's grammar: the ops models use, each with its typing rule.

Every op has

* ``sample(b)``: pick operands among the graph's nodes (or new inputs tied to
  their shapes) and attributes, or ``None`` when nothing fits;
* ``infer(g, n)``: the result's shape, dtype, value range and accumulation
  length, raising ``Invalid`` when the operands do not fit (the minimiser
  relies on this after it shrinks shapes);
* ``code(g, n, args)``: the Python expression (plain ``torch``).

Value ranges (interval arithmetic) keep every value finite and away from the
ill-conditioned spots of the grammar: ``exp`` only of values at most 5, a
divisor, ``log``, ``sqrt`` and ``rsqrt`` only of operands bounded away from 0,
comparisons only of graph inputs (a comparison of computed values flips with
the last bit), casts to 16 bits rounded like any op (their rounding is part
of the reference's noise model, ``oracle.py``).
"""

from torch_spyre.tools.fuzz.ops.base import MAX_BOUND, OPS, Op

# The registry's order is the import order of these modules (each registers its
# ops as it is imported), and the generator draws ops in that order: the same
# seed makes the same graph only while it stays as it is.
# isort: off
from torch_spyre.tools.fuzz.ops import elementwise  # noqa: F401
from torch_spyre.tools.fuzz.ops import reductions  # noqa: F401
from torch_spyre.tools.fuzz.ops import views  # noqa: F401
from torch_spyre.tools.fuzz.ops import indexing  # noqa: F401
from torch_spyre.tools.fuzz.ops import contractions  # noqa: F401
from torch_spyre.tools.fuzz.ops import casts  # noqa: F401
from torch_spyre.tools.fuzz.ops import routing  # noqa: F401
# isort: on

__all__ = ["MAX_BOUND", "OPS", "Op"]
