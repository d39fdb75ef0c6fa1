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


class Fp8ArithmeticError(NotImplementedError):
    """Arithmetic on 8-bit float tensors outside the quantised kernels (a
    NotImplementedError like the CPU's for fp8 arithmetic, and not a
    TypeError, which Python's operators would turn into a generic message)."""


def fp8_arithmetic(op_name: str, dtype: torch.dtype) -> Fp8ArithmeticError:
    """The error for arithmetic on 8-bit float tensors outside the quantised
    kernels: the card converts fp8 to and from its 16-bit type and feeds fp8
    to the PE array in the quantised matmuls; it has no other fp8 arithmetic."""
    name = str(dtype).removeprefix("torch.")
    return Fp8ArithmeticError(
        f"spyre: aten.{op_name} on {name} tensors: the card does no arithmetic on 8-bit "
        "floats outside its quantised kernels (torch.ops.spyre.dequantize_fp8_with_scale, "
        "torch.ops.spyre.quantized_linear, torch._scaled_mm). Dequantize or convert first, "
        "e.g. x.to(torch.float16) * scale"
    )


def fp8_operand(args, kwargs) -> torch.dtype | None:
    """The 8-bit float dtype of a tensor argument of a call, if any."""
    from torch_spyre.layout import FP8_DTYPES

    for a in (*args, *kwargs.values()):
        if type(a) is torch.Tensor and a.dtype in FP8_DTYPES:
            return a.dtype
        if isinstance(a, list | tuple):
            for b in a:
                if type(b) is torch.Tensor and b.dtype in FP8_DTYPES:
                    return b.dtype
    return None
