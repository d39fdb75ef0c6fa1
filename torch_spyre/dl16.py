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

from torch_spyre import _card

#: the NaN/infinity pattern (magnitude bits), and the largest finite value
NINF = 0x7FFF
MAX = 2.0**32 * (1 + 510 / 512)


# The conversions are loops in csrc/card/dl16.h (a DL16 card converts every
# operand it reads and writes: in torch ops they took half of a DL16 decode).
def encode(values: torch.Tensor) -> torch.Tensor:
    """DL16 bits (int16) of float ``values`` (any float dtype, via fp32)."""
    return _card.dl16_encode(values.to(torch.float32).contiguous())


def decode(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of DL16 ``bits`` (int16; NINF -> NaN)."""
    return _card.dl16_decode(bits.contiguous())


def round_trip(values: torch.Tensor) -> torch.Tensor:
    """``values`` as the card holds them (DL16-rounded), in fp32."""
    return decode(encode(values))
