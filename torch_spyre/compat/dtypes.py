"""IBM's data formats: ``DataFormats``, ``get_device_dtype``, ``get_elem_in_stick``."""

from __future__ import annotations

import enum
from typing import Any

import torch

from torch_spyre.layout import (
    check_dtype,
    stick_elems,
)


class DataFormats(enum.Enum):
    """How device memory stores elements, in IBM's names (a plain Enum: its
    members print as ``DataFormats.SEN169_FP16``, as IBM's do)."""

    SEN169_FP16 = "float16"  # the card's 16-bit float (IBM's DL16 slot)
    BFLOAT16 = "bfloat16"
    IEEE_FP32 = "float32"
    SEN143_FP8 = "float8_e4m3fn"  # 1 sign, 4 exponent, 3 mantissa bits
    SEN152_FP8 = "float8_e5m2"  # 1 sign, 5 exponent, 2 mantissa bits
    SENINT8 = "int8"
    SENUINT8 = "uint8"
    SENINT16 = "int16"
    IEEE_INT32 = "int32"
    IEEE_INT64 = "int64"  # IBM narrows int64 to IEEE_INT32; we store it exactly
    BOOL = "bool"  # one byte; IBM stores bool as SEN169_FP16
    IEEE_COMPLEX64 = "complex64"  # ours: interleaved fp32 (re, im) pairs; IBM has none

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.value)


def get_device_dtype(dtype: torch.dtype) -> DataFormats:
    """The ``DataFormats`` in which device memory stores host ``dtype``."""
    if isinstance(dtype, DataFormats):
        return dtype
    check_dtype(dtype)  # the TypeError names the supported set
    return DataFormats(str(dtype).removeprefix("torch."))


def get_elem_in_stick(dtype: torch.dtype | DataFormats) -> int:
    """Elements of ``dtype`` in one 128-byte stick."""
    return stick_elems(_host_dtype(dtype))


def _host_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, DataFormats):
        return dtype.torch_dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(
        f"expected a torch.dtype or a torch.spyre.DataFormats member, got {dtype!r} "
        f"(e.g. torch.float16 or DataFormats.SEN169_FP16)"
    )
