"""Tolerances for comparing spyre results with the CPU, chosen in one place.

Used by the tests and by the op-coverage tool (``torch_spyre.tools.opcheck``),
whose report quotes ``TOLERANCE_NOTE``.
"""

from __future__ import annotations

import torch

#: (rtol, atol) per result dtype, derived in TOLERANCE_NOTE
TOLERANCE_TABLE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),  # 8-bit significand: eps = 2^-7 = 7.8e-3
}

TOLERANCE_NOTE = """\
Both sides get bit-identical inputs, so differences come only from how a
result is computed: rounding of intermediates and the order of accumulation.
OpInfo samples hold values in [-9, 9] and dims of at most a few tens
(S=5, M=10, L=20), so reductions have at most a few hundred terms and
intermediates (products, contractions of contractions such as attention
logits) reach magnitudes of about 1e3.

* float16 has an 11-bit significand: eps = 2^-10 = 9.8e-4, so rounding the
  result alone costs up to 0.5 ulp on each side (about 1e-3 relative between
  the two).  A device kernel may keep intermediates in fp16 where the CPU
  keeps them in fp32 (or the reverse) and may sum in another order (per-core
  partial sums, then a ring reduction); each rounded step adds up to an ulp,
  and a sum of n terms up to n*eps relative in the worst case, about
  sqrt(n)*eps typically: a few to ten ulps, **rtol = 1e-2**.  A result near
  zero comes from cancellation, where a relative bound means nothing and the
  error is an ulp or so of the operands: ulp(8..16) = 2^-7 = 7.8e-3 for
  OpInfo's operands, so **atol = 1e-2**.
* float32: eps = 2^-23 = 1.19e-7; n*eps for sums of up to ~1000 terms gives
  **rtol = 1e-4**.  Cancellation among intermediates of magnitude ~1e3
  (ulp(1024) = 1.2e-4; ulp(256) = 3.1e-5) gives **atol = 1e-4**:
  PyTorch's float32 default atol (1e-5) only holds for O(1) operands.
* For comparison, PyTorch's own device-vs-CPU test (`test_compare_cpu` in
  test/test_ops.py) uses rtol = atol = 1e-3 for every dtype on CUDA and
  1e-4 on XPU.
* Integer and bool results (indices, comparisons, counts) must be equal.
  Python float results use the tolerance of the dtype under test; other
  non-tensor results (ints, bools, shapes, None) must be equal (==).
* Values are not compared, only shape, dtype and device, for ops that draw
  random numbers (any aten op they call carries the `nondeterministic_seeded`
  tag) and for ops whose results are uninitialized memory (empty*).
"""


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """rtol/atol for ``torch.testing.assert_close`` of a ``dtype`` result
    (integer and bool results must be equal)."""
    rtol, atol = TOLERANCE_TABLE.get(dtype, (0.0, 0.0))
    return {"rtol": rtol, "atol": atol}
