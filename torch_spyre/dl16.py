"""IBM's DL16 (DLFloat16, "SEN169"): the card's 16-bit floating-point format.

1 sign bit, 6 exponent bits (bias 31), 9 fraction bits; no subnormals, no
infinity: the all-ones pattern (per sign) is "NINF", which converts back as
NaN; values past the largest (~8.57e9) become NINF, values below 2^-31
flush to zero.  fp32 -> DL16 rounds the magnitude to nearest with ties away
from zero (it adds half an ulp and truncates).  The conversions follow the
published NNP1 conversion of IBM's onnx-mlir (DLF16Conversion.hpp).

Compared with IEEE fp16 (5 exponent, 10 fraction bits): a 5.6e5x larger
range (x*x of activations in the thousands does not overflow) and half the
precision (2^-9 relative).  torch has no such dtype: the bits live in int16
tensors, the values in fp32.
"""

from __future__ import annotations

import torch

#: the NaN/infinity pattern (magnitude bits), and the largest finite value
NINF = 0x7FFF
MAX = 2.0**32 * (1 + 510 / 512)
_BIAS_SHIFT = 127 - 31  # fp32 bias - DL16 bias
# largest fp32 bit pattern (magnitude) that rounds to a finite DL16 value
_NMAX32 = ((63 + _BIAS_SHIFT) << 23) | (510 << 14) | ((1 << 13) - 1)


def encode(values: torch.Tensor) -> torch.Tensor:
    """DL16 bits (int16) of float ``values`` (any float dtype, via fp32)."""
    b = values.to(torch.float32).contiguous().view(torch.int32)
    sign = (b >> 31) & 1
    mag = b & 0x7FFFFFFF
    e = ((b >> 23) & 0xFF) - _BIAS_SHIFT
    frac = (b & 0x7FFFFF) + (1 << 13)  # + half an ulp of the 9-bit fraction
    carry = frac > 0x7FFFFF
    e = e + carry.to(torch.int32)
    frac = torch.where(carry, 0, frac)
    finite = (e >= 0) & (mag <= _NMAX32)
    out = torch.where(finite, (e << 9) | (frac >> 14), torch.where(e >= 0, NINF, 0))
    return (out | (sign << 15)).to(torch.int16)


def decode(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of DL16 ``bits`` (int16; NINF -> NaN)."""
    u = bits.to(torch.int32) & 0xFFFF
    sign = (u >> 15) << 31
    mag = u & 0x7FFF
    b = sign | (((mag >> 9) + _BIAS_SHIFT) << 23) | ((mag & 0x1FF) << 14)
    b = torch.where(mag == 0, sign, b)
    b = torch.where(mag == NINF, sign | 0x7FC00000, b)
    return b.view(torch.float32)


def round_trip(values: torch.Tensor) -> torch.Tensor:
    """``values`` as the card holds them (DL16-rounded), in fp32."""
    return decode(encode(values))
