"""Quantised data on the card: quantise and dequantise with a scale, the
weight-only quantised linear (W8A16) and ``aten._scaled_mm`` (W8A8).

The card stores 8-bit floats (``float8_e4m3fn``, ``float8_e5m2``) and int8 in
sticks of 128 and computes in fp16 (../shared/hardware.md: "int8/int4/fp8 for
quantised weights"; the vector units do the (de)quantisation, the PE array
consumes 8-bit data at twice its fp16 rate).  Three ops of ours, each one
kernel program on the card and, on any other device, the math below
(``CompositeImplicitAutograd``: also what ``torch.compile`` traces, so the
compiler plans them with their neighbours, docs/compiler.md):

* ``torch.ops.spyre.quantize(x, scale, dtype=float8_e4m3fn)``:
  ``(x / scale).clamp(-max, max).to(dtype)`` for fp8 (``max`` the type's
  largest finite value, 448 for e4m3), ``round(x / scale).clamp(-128,
  127).to(int8)`` for int8; ``scale`` broadcasts against ``x`` (one per
  tensor, row or channel);
* ``torch.ops.spyre.dequantize(q, scale, dtype=float16)``:
  ``(q.to(dtype) * scale).to(dtype)``;
* ``torch.ops.spyre.quantized_linear(x, weight, weight_scale, bias=None)``:
  ``F.linear(x, (weight.to(s.dtype) * s).to(x.dtype), bias)`` for an 8-bit
  ``weight [N, K]`` and a per-tensor (one element) or per-output-channel
  (``[N]`` or ``[N, 1]``) ``weight_scale`` (the checkpoints' dequantisation
  rule: in the scale's type, then the activations').  On the card the weight
  streams in as 8-bit data (half the bytes of fp16) and is dequantised in
  LX; the PE array then runs at the activations' rate.

``aten._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` with fp8 ``a``
and ``b`` runs on the PE array at the 8-bit rate: ``(a @ b) * scale_a *
scale_b + bias`` accumulated in fp32, per-tensor or row-wise scales
(``[M, 1]`` and ``[1, N]``), rounded once to ``out_dtype``.

IBM's names (``spyre::quantize_fp8_with_scale`` and friends) are in
``torch_spyre.compat``, over these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torch_spyre.kernels import eager as programs
from torch_spyre.kernels import quant as quant_programs
from torch_spyre.layout import FP8_DTYPES
from torch_spyre.ops.matmul import _bias, _lhs, _rhs
from torch_spyre.ops.registry import NoKernel, kernel
from torch_spyre.runtime import dispatch_stats, launch, operands
from torch_spyre.runtime.registration import entry

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: the 8-bit types of quantised data
QUANT_DTYPES = (*FP8_DTYPES, torch.int8)

_lib = torch.library.Library("spyre", "FRAGMENT")
_lib.define("quantize(Tensor input, Tensor scale, ScalarType? dtype=None) -> Tensor")
_lib.define("dequantize(Tensor input, Tensor scale, ScalarType? dtype=None) -> Tensor")
_lib.define(
    "quantized_linear(Tensor input, Tensor weight, Tensor weight_scale, Tensor? bias=None) "
    "-> Tensor"
)


# ------------------------------------------------------------------- math
def _q_dtype(dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or torch.float8_e4m3fn
    if dtype not in QUANT_DTYPES:
        raise TypeError(
            f"spyre.quantize: cannot quantise to {dtype}; the card's quantised types are "
            "torch.float8_e4m3fn, torch.float8_e5m2 and torch.int8"
        )
    return dtype


def quantize_math(x: torch.Tensor, scale: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = _q_dtype(dtype)
    if dtype == torch.int8:
        return torch.round(x / scale).clamp(-128, 127).to(torch.int8)
    hi = float(torch.finfo(dtype).max)
    return (x / scale).clamp(-hi, hi).to(dtype)


def dequantize_math(q: torch.Tensor, scale: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = dtype or torch.float16
    return (q.to(dtype) * scale).to(dtype)


def channel_scale(scale: torch.Tensor, n: int, what: str = "weight_scale") -> torch.Tensor:
    """``scale`` as [N, 1] (per output channel) or [1, 1] (per tensor)."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() <= 2 and scale.numel() == n and scale.shape[0] == n:
        return scale.reshape(n, 1)
    raise NotImplementedError(
        f"spyre.quantized_linear: {what} of shape {list(scale.shape)} for {n} output channels; "
        "the card's quantised linear takes one scale per tensor or per output channel "
        "([N] or [N, 1]). Group-wise scales: dequantize the weight first "
        "(torch.ops.spyre.dequantize) and use F.linear"
    )


def quantized_linear_math(x, weight, weight_scale, bias=None) -> torch.Tensor:
    s = channel_scale(weight_scale, weight.shape[0])
    w = (weight.to(s.dtype) * s).to(x.dtype)
    return F.linear(x, w, bias)


_lib.impl("quantize", quantize_math, "CompositeImplicitAutograd")
_lib.impl("dequantize", dequantize_math, "CompositeImplicitAutograd")
_lib.impl("quantized_linear", quantized_linear_math, "CompositeImplicitAutograd")


# --------------------------------------------------------- device kernels
def _scale_operand(scale: torch.Tensor, shape: tuple[int, ...], op: str) -> torch.Tensor:
    try:
        torch.broadcast_shapes(tuple(scale.shape), shape)
    except RuntimeError:
        raise RuntimeError(
            f"spyre.{op}: scale of shape {list(scale.shape)} does not broadcast to the "
            f"input's {list(shape)}"
        ) from None
    if scale.dim() > len(shape):
        raise RuntimeError(f"spyre.{op}: scale {list(scale.shape)} has more dims than {shape}")
    return scale


def _elementwise(op: str, x: torch.Tensor, scale: torch.Tensor, out_dtype, build) -> torch.Tensor:
    if scale.device != x.device:
        raise RuntimeError(
            f"spyre.{op}: the scale is on {scale.device} and the input on {x.device}; move "
            "the scale to the card (scale.to(x.device))"
        )
    shape = tuple(x.shape)
    _scale_operand(scale, shape, op)
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    key = (op, shape, x.dtype, tuple(scale.shape), scale.dtype, out_dtype)
    k = launch.kernel(key, lambda: launch.Kernel(build()))
    if k.program is None:
        raise RuntimeError(f"spyre.{op}: no kernel program for {shape}: {k.info.get('rejected')}")
    out = torch.empty(shape, dtype=out_dtype, device=x.device)
    lay_shape = shape or (1,)
    k.launch(
        {
            "x": operands.whole(x).reshape(lay_shape),
            "s": operands.whole(scale).reshape(tuple(scale.shape) or (1,)),
            "out": out.reshape(lay_shape),
        }
    )
    dispatch_stats.record("kernel", f"spyre.{op}")
    return out


def _quantize_device(x: torch.Tensor, scale: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = _q_dtype(dtype)
    if x.dtype not in _FLOATS or scale.dtype not in _FLOATS:
        raise TypeError(
            f"spyre.quantize: quantises float16/bfloat16/float32 data with a float scale, "
            f"got {x.dtype} data and a {scale.dtype} scale"
        )
    quot = torch.result_type(x, scale)
    shape = tuple(x.shape)
    return _elementwise(
        "quantize",
        x,
        scale,
        dtype,
        lambda: quant_programs.quantize(
            shape, x.dtype, (tuple(scale.shape), scale.dtype), dtype, quot
        ),
    )


def _dequantize_device(q: torch.Tensor, scale: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = dtype or torch.float16
    if q.dtype not in QUANT_DTYPES or scale.dtype not in _FLOATS or dtype not in _FLOATS:
        raise TypeError(
            f"spyre.dequantize: dequantises float8/int8 data with a float scale into "
            f"float16/bfloat16/float32; got {q.dtype} data, a {scale.dtype} scale, {dtype} out"
        )
    shape = tuple(q.shape)
    # the product is computed in fp32 and rounded once: q.to(dtype) * scale
    # promotes to fp32 when the scale is a wider tensor, then .to(dtype)
    return _elementwise(
        "dequantize",
        q,
        scale,
        dtype,
        lambda: quant_programs.dequantize(shape, q.dtype, (tuple(scale.shape), scale.dtype), dtype),
    )


def _dequant_op(scale_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    """The vector op of ``(w.to(s.dtype) * s).to(out)``: the fp32 product is
    rounded to the scale's type first when that is a 16-bit type other than
    the output's."""
    if scale_dtype in (torch.float16, torch.bfloat16) and scale_dtype != out_dtype:
        return f"mul_via_{str(scale_dtype).removeprefix('torch.')}"
    return "mul"


def _quantized_linear_device(x, weight, weight_scale, bias=None) -> torch.Tensor:
    if (
        x.dtype not in _FLOATS
        or weight.dtype not in QUANT_DTYPES
        or weight.dim() != 2
        or weight_scale.dtype not in _FLOATS
    ):
        raise TypeError(
            "spyre.quantized_linear: float16/bfloat16/float32 activations with a 2-D "
            f"float8/int8 weight and a float scale; got {x.dtype} x, {weight.dtype} weight "
            f"{list(weight.shape)}, {weight_scale.dtype} scale"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise RuntimeError(
            f"spyre.quantized_linear: input [..., {x.shape[-1]}] and weight {list(weight.shape)} "
            "cannot be multiplied"
        )
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        raise RuntimeError(
            f"spyre.quantized_linear: bias must be [{n}] of the input's dtype {x.dtype}, got "
            f"{list(bias.shape)} {bias.dtype}"
        )
    s = channel_scale(weight_scale, n)
    out_shape = (*x.shape[:-1], n)
    rows = math.prod(x.shape[:-1])
    if x.numel() == 0 or rows == 0:
        return torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    a_t, a_index, row_sizes = _lhs(x.reshape(rows, k) if x.dim() != 2 else x, [])
    w_t, w_index = _rhs(weight.t(), [])  # read as the weight itself, indexed (n, k)
    per_channel = s.shape[0] == n
    s_t = operands.whole(s.reshape(n) if per_channel else s.reshape(1))
    s_index = ("n",) if per_channel else (None,)
    sizes = {**row_sizes, "n": n, "k": k}
    out_base = (*row_sizes.values(), n)
    bias_arg = None if bias is None else _bias(bias, list(row_sizes), n, rows)
    op = _dequant_op(s.dtype, x.dtype)
    key = (
        "qlinear",
        x.dtype,
        tuple(a_t.shape),
        a_index,
        weight.dtype,
        tuple(w_t.shape),
        w_index,
        tuple(s_t.shape),
        s.dtype,
        tuple(sorted(sizes.items())),
        None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
    )

    def build() -> launch.Kernel:
        return launch.Kernel(
            programs.matmul(
                tuple(a_t.shape),
                a_index,
                tuple(w_t.shape),
                w_index,
                out_base,
                (*row_sizes, "n"),
                sizes,
                x.dtype,
                bias=None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
                name=f"qlinear_{str(weight.dtype).removeprefix('torch.')}_"
                f"{'x'.join(map(str, out_shape))}x{k}",
                b_dtype=weight.dtype,
                dequant=(op, tuple(s_t.shape), s_index, s.dtype),
            )
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        raise RuntimeError(
            f"spyre.quantized_linear: no kernel program for {out_shape}x{k}: "
            f"{kern.info.get('rejected')}"
        )
    out = torch.empty(out_base, dtype=x.dtype, device=x.device)
    bind = {"a": a_t, "b": w_t, "ws": s_t, "out": out}
    if bias_arg is not None:
        bind["bias"] = bias_arg[0]
    kern.launch(bind)
    dispatch_stats.record("kernel", "spyre.quantized_linear")
    return out.view(out_shape)


_registered = False


def register() -> None:
    """The spyre kernels of the quantisation ops (``ops.register`` calls it)."""
    global _registered
    if not _registered:
        _lib.impl("quantize", entry(_quantize_device), "PrivateUse1")
        _lib.impl("dequantize", entry(_dequantize_device), "PrivateUse1")
        _lib.impl("quantized_linear", entry(_quantized_linear_device), "PrivateUse1")
        _registered = True


# ------------------------------------------------------------- _scaled_mm
def _mm_scale(scale: torch.Tensor, rows: int, which: str, dim: str):
    """(operand, index) of a ``_scaled_mm`` scale: one per tensor, or one per
    row of ``a`` ([M, 1]) / column of ``b`` ([1, N])."""
    if scale.numel() == 1:
        return operands.whole(scale.reshape(1)), (None,)
    want = (rows, 1) if which == "scale_a" else (1, rows)
    if tuple(scale.shape) == want:
        return operands.whole(scale.reshape(rows)), (dim,)
    raise NotImplementedError(
        f"spyre: aten._scaled_mm {which} of shape {list(scale.shape)}; the card takes one "
        f"scale per tensor or {list(want)} (row-wise)"
    )


@kernel("_scaled_mm.default", fp8=True)
def _scaled_mm(
    a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES or a.dim() != 2 or b.dim() != 2:
        raise TypeError(
            "spyre: aten._scaled_mm multiplies 2-D float8 matrices; got "
            f"{a.dtype} {list(a.shape)} and {b.dtype} {list(b.shape)}"
        )
    if scale_result is not None:
        raise NoKernel  # an fp8 output: the host computes it (counted)
    out_dtype = out_dtype or a.dtype
    if out_dtype not in _FLOATS:
        raise NoKernel
    m, k = a.shape
    if b.shape[0] != k:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {b.shape[0]}x{b.shape[1]})"
        )
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((m, n), dtype=out_dtype, device=a.device)
        return out if bias is None else out + bias
    a_t, a_index, rows = _lhs(a, [])
    b_t, b_index = _rhs(b, [])
    sa, sa_index = _mm_scale(scale_a, m, "scale_a", "m0")
    sb, sb_index = _mm_scale(scale_b, n, "scale_b", "n")
    bias_arg = None if bias is None else _bias(bias, list(rows), n, m)
    if bias is not None and (bias_arg is None or bias.dtype != out_dtype):
        raise NoKernel
    sizes = {**rows, "n": n, "k": k}
    key = (
        "scaled_mm",
        a.dtype,
        b.dtype,
        tuple(a_t.shape),
        a_index,
        tuple(b_t.shape),
        b_index,
        (tuple(sa.shape), sa.dtype, sa_index),
        (tuple(sb.shape), sb.dtype, sb_index),
        out_dtype,
        None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
    )

    def build() -> launch.Kernel:
        return launch.Kernel(
            programs.matmul(
                tuple(a_t.shape),
                a_index,
                tuple(b_t.shape),
                b_index,
                (m, n),
                ("m0", "n"),
                sizes,
                out_dtype,
                bias=None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
                name=f"scaled_mm_{m}x{n}x{k}",
                a_dtype=a.dtype,
                b_dtype=b.dtype,
                scales=(
                    ("sa", tuple(sa.shape), sa_index, sa.dtype),
                    ("sb", tuple(sb.shape), sb_index, sb.dtype),
                ),
            )
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return NotImplemented
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    bind = {"a": a_t, "b": b_t, "sa": sa, "sb": sb, "out": out}
    if bias_arg is not None:
        bind["bias"] = bias_arg[0]
    kern.launch(bind)
    return out
