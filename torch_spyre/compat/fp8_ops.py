"""IBM's ``torch.ops.spyre`` fp8 ops over ours (``torch_spyre/ops/quantized.py``)."""

from __future__ import annotations

import torch

#: IBM's torch.ops.spyre fp8 ops over ours (torch_spyre/ops/quantized.py), with
#: IBM's semantics (its spyre-inference tests/test_fp8.py reference):
#: quantize = (x / scale).clamp(-FP8_E4M3FN_MAX, FP8_E4M3FN_MAX).to(float8_e4m3fn),
#: dequantize = x_fp8.to(float16) * scale (float16 out); the scale broadcasts
#: against the input (IBM: [1] per tensor or [batch, seq, 1] per token).
#: ``quantize_weight_fp8_with_scale`` gives the same values (IBM's weight
#: layout, QFP8WT, is a layout of IBM's compiler; ours is the one stick layout).
#: ``qfp8ch`` / ``qfp8wt`` are the format conversion alone (input already
#: scaled and clamped).  Composite ops: one device kernel eagerly, and what
#: torch.compile traces into the compiler's programs.
_IBM_FP8_OPS = {
    "quantize_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.quantize(input, scale, torch.float8_e4m3fn)
    ),
    "quantize_weight_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.quantize(input, scale, torch.float8_e4m3fn)
    ),
    "dequantize_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.dequantize(input, scale, torch.float16)
    ),
    "qfp8ch(Tensor input) -> Tensor": lambda input: input.to(torch.float8_e4m3fn),
    "qfp8wt(Tensor input) -> Tensor": lambda input: input.to(torch.float8_e4m3fn),
}
_ibm_lib: list[torch.library.Library] = []


def _install_fp8_ops() -> None:
    if _ibm_lib:
        return
    import torch_spyre.ops.quantized  # noqa: F401  (defines spyre::quantize, dequantize)

    lib = torch.library.Library("spyre", "FRAGMENT")
    for schema, fn in _IBM_FP8_OPS.items():
        lib.define(schema)
        lib.impl(schema.split("(")[0], fn, "CompositeImplicitAutograd")
    _ibm_lib.append(lib)
