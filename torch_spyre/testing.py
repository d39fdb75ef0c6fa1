"""Tolerances for comparing spyre results with the CPU, justified once.

fp16 keeps 11 significant bits (eps = 2**-10 = 9.8e-4): one rounding of a
result computed in fp32 (as the vector unit and the PE array do) is within
half an ulp of the CPU's, but reductions and matmuls accumulate in a
different order and their fp16 inputs were already rounded, which costs a few
ulps relative to the largest term: rtol = atol = 1e-2 covers sums of
hundreds of terms.  bf16 (8 bits, eps 7.8e-3) gets 5e-2.  fp32 results
differ only by accumulation order: 1e-5 relative plus 1e-5 absolute (for
values that cancel to near zero); matmul/reduction sums over long rows get
1e-4.
"""

from __future__ import annotations

import torch

_TOLERANCES = {
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 5e-2, "atol": 5e-2},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
_LONG_SUM_FP32 = {"rtol": 1e-4, "atol": 1e-4}


def tolerances(dtype: torch.dtype, long_sums: bool = False) -> dict[str, float]:
    """rtol/atol for ``torch.testing.assert_close`` of a ``dtype`` result."""
    if dtype == torch.float32 and long_sums:
        return dict(_LONG_SUM_FP32)
    return dict(_TOLERANCES.get(dtype, {"rtol": 0.0, "atol": 0.0}))
