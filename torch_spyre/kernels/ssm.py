"""State-space (Mamba-2) kernels: the causal depthwise conv1d and the SSM scans.

* ``depthwise_conv1d``: ``out[b, t, c] = bias[c] + sum_j w[j, c] * x[b, t + j, c]``
  over a time-major input already padded on the left (causal: ``K - 1`` zero
  rows).  Channels are the stick dim, so each tap is a load of the same rows
  shifted by ``j`` *rows* (whole sticks: a DMA can do that, it cannot shift
  lanes), multiplied by the tap's weights and accumulated on the vector
  units: ``K`` reads of the input per output tile, as a dataflow core without
  a sliding-window buffer does it.

The scans are in ``kernels/ssd.py``.
"""

from __future__ import annotations

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Buffer, Dim, Load, Operand, Program, Store, Vector
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


def depthwise_conv1d(
    b: int,
    t_out: int,
    c: int,
    k: int,
    dtype: torch.dtype = torch.float16,
    *,
    bias: bool = True,
    config: HardwareConfig | None = None,
    name: str | None = None,
) -> Program:
    """Operands ``x`` [b, t_out + k - 1, c] (padded, time-major), ``w`` [k, c]
    (the taps), ``bias`` [c] when ``bias``, ``out`` [b, c, t_out] (the
    convolution's own layout: the store writes the tile channel-major)."""
    cfg = config or HardwareConfig()
    se = stick_elems(dtype)
    pc = max(1, min(cfg.cores, ceil_div(c, se)))
    ec = ceil_div(ceil_div(c, se), pc) * se if pc > 1 else c
    pc = ceil_div(c, ec)
    # time is the stick dim of the output: each core stores whole sticks of it
    pt = max(1, min(cfg.cores // pc, ceil_div(t_out, se)))
    et = ceil_div(ceil_div(t_out, se), pt) * se if pt > 1 else t_out
    pt = ceil_div(t_out, et)
    pb = max(1, min(cfg.cores // (pc * pt), b))
    c_pad = ceil_div(min(ec, c), 32) * 32  # fp32 sticks of the core's channels
    # x tile (double buffered, fp32-held), product, accumulator, out (double buffered)
    per_row = c_pad * 4 * 6
    tt = max(1, min(et, (cfg.lx_bytes // 2 - k * c_pad * 4) // per_row))
    dims = (
        Dim("b", b, pb, 1),
        Dim("t", t_out, pt, tt, chunk=et if pt > 1 else None),
        Dim("c", c, pc, chunk=ec if pc > 1 else None),
    )
    loops = ("b", "t")
    steps: list = []
    buffers = [
        Buffer("xt", ("b", "t", "c"), dtype, True),
        Buffer("prod", ("b", "t", "c"), torch.float32),
        Buffer("acc", ("b", "t", "c"), torch.float32, True),
    ]
    for j in range(k):  # the taps, loaded once per core
        steps.append(Load(f"w{j}", "w", (None, "c"), (), offsets=(j, 0)))
        buffers.append(Buffer(f"w{j}", ("c",), torch.float32))
    if bias:
        steps.append(Load("bt", "bias", ("c",), ()))
        buffers.append(Buffer("bt", ("c",), torch.float32))
    for j in range(k):
        steps.append(Load("xt", "x", ("b", "t", "c"), loops, offsets=(0, j, 0)))
        if j == 0:
            steps.append(Vector("mul", "acc", ("xt", "w0"), (), loops))
        else:
            steps.append(Vector("mul", "prod", ("xt", f"w{j}"), (), loops))
            steps.append(Vector("add", "acc", ("acc", "prod"), (), loops))
    if bias:
        steps.append(Vector("add", "acc", ("acc", "bt"), (), loops))
    steps.append(Store("out", "acc", ("b", "c", "t"), loops))
    lay = SpyreTensorLayout.default
    operands = [
        Operand("x", lay((b, t_out + k - 1, c), dtype), "input"),
        Operand("w", lay((k, c), dtype), "input"),
    ]
    if bias:
        operands.append(Operand("bias", lay((c,), dtype), "input"))
    operands.append(Operand("out", lay((b, c, t_out), dtype), "output"))
    return Program(
        name=name or f"conv1d_dw_{b}x{t_out}x{c}_k{k}",
        dims=dims,
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )
