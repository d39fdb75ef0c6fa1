"""Inductor's names for the vector ops of the IR (``ir/vector_ops.py``).

``_UNARY`` and ``_BINARY`` map Inductor ops-handler names to vector ops;
``_PY_BINARY`` folds a binary op of two constants on the host.
"""

from __future__ import annotations

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
    "floor": "floor",
    "ceil": "ceil",
    "trunc": "trunc",
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
    "floordiv": "floordiv",
    "truncdiv": "truncdiv",
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
    "floordiv": lambda a, b: a // b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "logical_and": lambda a, b: bool(a) and bool(b),
    "logical_or": lambda a, b: bool(a) or bool(b),
}
#: ops whose value is a bool whatever the operands' dtype
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or")
