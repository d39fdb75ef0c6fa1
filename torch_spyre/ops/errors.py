"""Errors raised while an aten op runs on spyre name the op and its shapes."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def describe(args, kwargs) -> str:
    parts = []
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}@{a.device}")
    return ", ".join(parts) or "no tensors"


def annotated(err: Exception, op_name: str, args, kwargs) -> Exception:
    """``err`` with "(spyre: aten.op on shapes)" appended, same type when possible."""
    note = f" [spyre: aten.{op_name} on {describe(args, kwargs)}]"
    if note in str(err) or "[spyre: aten." in str(err):
        return err
    try:
        new = type(err)(f"{err}{note}")
    except Exception:  # an exception type with a different constructor
        err.add_note(note.strip())
        return err
    new.__cause__ = err.__cause__
    return new
