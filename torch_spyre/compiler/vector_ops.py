"""The vector ops the compiler adds to the simulator, and Inductor's names for them.

Importing this module registers, append-only, the vector ops and reductions
the lowering emits beyond the stock set (comparisons, where, logical ops,
pow, erf, the fill / bcast helpers, ``any`` and the online-softmax
``logsumexp`` reduction) in ``torch_spyre.sim.ops``; ``_UNARY`` and
``_BINARY`` map Inductor ops-handler names to those vector ops, and
``_PY_BINARY`` folds a binary op of two constants on the host.
"""

from __future__ import annotations

import math

import torch

from torch_spyre.sim import ops as sim_ops


# ----------------------------------------------------------- vector ops we add
def _register_ops() -> None:
    """Vector ops the compiler needs beyond the stock set (append-only)."""
    new = [
        ("erf", torch.erf, "transcendental", 1),
        ("maximum_scalar", lambda x, s: torch.clamp_min(x, s), "simple", 1),
        ("minimum_scalar", lambda x, s: torch.clamp_max(x, s), "simple", 1),
        ("where", torch.where, "simple", 3),
        ("lt", torch.lt, "simple", 2),
        ("le", torch.le, "simple", 2),
        ("gt", torch.gt, "simple", 2),
        ("ge", torch.ge, "simple", 2),
        ("eq", torch.eq, "simple", 2),
        ("ne", torch.ne, "simple", 2),
        ("logical_and", torch.logical_and, "simple", 2),
        ("logical_or", torch.logical_or, "simple", 2),
        ("logical_not", torch.logical_not, "simple", 1),
        ("pow", torch.pow, "transcendental", 2),
        ("log1p", torch.log1p, "transcendental", 1),
        ("expm1", torch.expm1, "transcendental", 1),
        ("sign", torch.sign, "simple", 1),
        # T5's fp16 overflow guard: isinf(x).any() picks the clamp bound
        ("isinf", torch.isinf, "simple", 1),
        # range reduction of sin/cos (compiler/trig.py)
        ("round", torch.round, "simple", 1),
        # modular index arithmetic (a rolled sliding-window cache): a division
        ("fmod", torch.fmod, "transcendental", 2),
        ("remainder", torch.remainder, "transcendental", 2),
        ("isnan", torch.isnan, "simple", 1),
        ("fill", lambda v: torch.tensor(v, dtype=torch.float32), "simple", 0),
        # the first input repeated along the dims of the second (which only gives shape)
        ("bcast", lambda a, b: torch.broadcast_tensors(a, b)[0], "simple", 2),
    ]
    for name, fn, cost, n in new:
        if name not in sim_ops.VECTOR_OPS:
            sim_ops.register_op(name, fn, cost, n)
    if "any" not in sim_ops.REDUCTIONS:
        sim_ops.register_reduction("any", lambda x, d: x.bool().any(d), 0.0)
    if "logsumexp" not in sim_ops.REDUCTIONS:
        # online softmax statistics of a streamed row (``_online_softmax``): a
        # running max m and sum s, rescaled by exp(m_old - m_new) per tile;
        # per input stick: max, subtract, exp, accumulate
        sim_ops.register_reduction(
            "logsumexp",
            lambda x, d: torch.logsumexp(x, d),
            -math.inf,
            extra_cost=("simple", "simple", "transcendental"),
        )


_register_ops()

_UNARY = {
    "exp": "exp",
    "log": "log",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "reciprocal": "reciprocal",
    "neg": "neg",
    "abs": "abs",
    "relu": "relu",
    "erf": "erf",
    "log1p": "log1p",
    "expm1": "expm1",
    "sign": "sign",
    "logical_not": "logical_not",
    "isinf": "isinf",
    "isnan": "isnan",
    "square": "square",
    "silu": "silu",
}
_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "truediv": "div",
    "div": "div",
    "maximum": "maximum",
    "minimum": "minimum",
    "lt": "lt",
    "le": "le",
    "gt": "gt",
    "ge": "ge",
    "eq": "eq",
    "ne": "ne",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "pow": "pow",
    "mod": "fmod",  # Inductor's ops.mod: C semantics (the sign of the dividend)
    "fmod": "fmod",
    "remainder": "remainder",
}
_PY_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b,
    "div": lambda a, b: a / b,
    "maximum": max,
    "minimum": min,
    "pow": lambda a, b: a**b,
}
