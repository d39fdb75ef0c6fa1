"""Kernel programs of the quantisation ops: quantise and dequantise with a scale.

Both are one pass of the vector units over the tensor (the card's SFU does
(de)quantisation, ../shared/hardware.md), with the scale broadcast by dim
name (one per tensor, per row or per channel):

* quantise: ``q = convert(clamp(x / s, -max, max))``, the quotient rounded
  to the type of ``x / s`` (as the CPU computes it), then converted to the
  8-bit type (fp8: round to nearest even; int8: round half to even first);
* dequantise: ``y = q * s`` computed in fp32, rounded once to the output type.

The matmuls with quantised operands are ``programs.matmul`` (``dequant=`` and
``scales=``).
"""

from __future__ import annotations

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Buffer, Load, Operand, Program, Store, Vector
from torch_spyre.ir import vector_ops as sim_ops
from torch_spyre.kernels.basic import broadcast_index
from torch_spyre.kernels.eager import _core_dims, _loop_prefix
from torch_spyre.layout import SpyreTensorLayout, stick_elems

# vector ops of the (de)quantisation programs (append-only: "simple" class,
# one pass per stick like a cast)
for _name, _fn in (
    ("clamp_scalar", lambda x, lo, hi: torch.clamp(x, lo, hi)),
    ("round_even", torch.round),
    # a product rounded to a 16-bit type before the output's own rounding
    # (a weight dequantised in its scale's type, then cast: checkpoints' rule)
    ("mul_via_float16", lambda a, b: (a * b).to(torch.float16)),
    ("mul_via_bfloat16", lambda a, b: (a * b).to(torch.bfloat16)),
):
    if _name not in sim_ops.VECTOR_OPS:
        sim_ops.register_op(
            _name, _fn, "simple", 1 if _name in ("clamp_scalar", "round_even") else 2
        )


def _pointwise(
    name: str,
    shape: tuple[int, ...],
    x_dtype: torch.dtype,
    scale: tuple[tuple[int, ...], torch.dtype],
    out_dtype: torch.dtype,
    chain: list[tuple[str, str, tuple[str, ...], tuple[float, ...], torch.dtype]],
    config: HardwareConfig | None,
) -> Program:
    """Operands ``x`` (``shape``), ``s`` (broadcast to it), ``out``; ``chain`` of
    vector steps (op, out buffer, input buffers, scalars, buffer dtype) from
    the loaded tiles ``x_t`` and ``s_t`` to ``out_t``."""
    cfg = config or HardwareConfig()
    shape = tuple(shape) or (1,)
    names = [f"d{i}" for i in range(len(shape))]
    sshape, sdt = scale
    sshape = tuple(sshape) or (1,)
    inter = {b: dt for _, b, _, _, dt in chain}
    nbytes = 2 * (x_dtype.itemsize + out_dtype.itemsize) + sum(
        dt.itemsize for b, dt in inter.items() if b != "out_t"
    )
    stick = max(stick_elems(x_dtype), stick_elems(out_dtype))
    dims = _core_dims(shape, nbytes / 2, cfg, names, stick)
    loops = tuple(names)
    sindex = broadcast_index(sshape, shape, names, name)
    used = tuple(d for d in sindex if d is not None)
    buffers = {
        "x_t": Buffer("x_t", loops, x_dtype, True),
        "s_t": Buffer("s_t", used, sdt, True),
    }
    for _, b, _, _, dt in chain:
        if b not in buffers:
            buffers[b] = Buffer(b, loops, dt, b == "out_t")
    steps: list = [
        Load("s_t", "s", sindex, _loop_prefix(loops, used)),
        Load("x_t", "x", loops, loops),
    ]
    steps += [Vector(op, out, ins, sc, loops) for op, out, ins, sc, _ in chain]
    steps.append(Store("out", "out_t", loops, loops))
    return Program(
        name=f"{name}_{'x'.join(map(str, shape))}",
        dims=dims,
        operands=(
            Operand("x", SpyreTensorLayout.default(shape, x_dtype), "input"),
            Operand("s", SpyreTensorLayout.default(sshape, sdt), "input"),
            Operand("out", SpyreTensorLayout.default(shape, out_dtype), "output"),
        ),
        buffers=tuple(buffers.values()),
        steps=tuple(steps),
        loop_order=loops,
    )


def quantize(
    shape: tuple[int, ...],
    x_dtype: torch.dtype,
    scale: tuple[tuple[int, ...], torch.dtype],
    q_dtype: torch.dtype,
    quot: torch.dtype,
    config: HardwareConfig | None = None,
) -> Program:
    """``out = convert(clamp(x / s, lo, hi))`` into ``q_dtype`` (fp8: +-its largest
    finite value; int8: round half to even, then [-128, 127]); the quotient is
    rounded to ``quot`` (``torch.result_type(x, s)``)."""
    if q_dtype == torch.int8:
        lo, hi = -128.0, 127.0
        chain = [
            ("div", "q_t", ("x_t", "s_t"), (), quot),
            ("round_even", "q_t", ("q_t",), (), quot),
        ]
    else:
        hi = float(torch.finfo(q_dtype).max)
        lo = -hi
        chain = [("div", "q_t", ("x_t", "s_t"), (), quot)]
    chain += [
        ("clamp_scalar", "q_t", ("q_t",), (lo, hi), quot),
        ("copy", "out_t", ("q_t",), (), q_dtype),
    ]
    return _pointwise("quantize", shape, x_dtype, scale, q_dtype, chain, config)


def dequantize(
    shape: tuple[int, ...],
    q_dtype: torch.dtype,
    scale: tuple[tuple[int, ...], torch.dtype],
    out_dtype: torch.dtype,
    config: HardwareConfig | None = None,
) -> Program:
    """``out = q * s`` in fp32, rounded once to ``out_dtype``."""
    chain = [("mul", "out_t", ("x_t", "s_t"), (), out_dtype)]
    return _pointwise("dequantize", shape, q_dtype, scale, out_dtype, chain, config)
