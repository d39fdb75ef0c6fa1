"""Numbers where an aten schema wants a Tensor.

PyTorch wraps Python numbers into 0-dim "wrapped number" tensors for ops like
``x % 2``; a Python boxed kernel receives them back as plain numbers.  Calling
the op again (on the CPU, on meta tensors) needs them as tensors again.
"""

from __future__ import annotations

from typing import Any

import torch

_tensor_args: dict[Any, tuple[tuple[int, str], ...]] = {}


def _positions(op) -> tuple[tuple[int, str], ...]:
    pos = _tensor_args.get(op)
    if pos is None:
        pos = tuple(
            (i, a.name) for i, a in enumerate(op._schema.arguments) if str(a.type) == "Tensor"
        )
        _tensor_args[op] = pos
    return pos


def rewrap(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with numbers in Tensor slots made 0-dim CPU tensors."""
    fixed_args = None
    fixed_kwargs = None
    if not kwargs and all(isinstance(v, torch.Tensor) for v in args):
        return args, kwargs  # the common case: nothing to wrap
    for i, name in _positions(op):
        if i < len(args):
            v = args[i]
            if isinstance(v, int | float | bool) and not isinstance(v, torch.Tensor):
                fixed_args = fixed_args or list(args)
                fixed_args[i] = torch.tensor(v)
        elif name in kwargs:
            v = kwargs[name]
            if isinstance(v, int | float | bool):
                fixed_kwargs = fixed_kwargs or dict(kwargs)
                fixed_kwargs[name] = torch.tensor(v)
    return (
        tuple(fixed_args) if fixed_args is not None else args,
        fixed_kwargs if fixed_kwargs is not None else kwargs,
    )
