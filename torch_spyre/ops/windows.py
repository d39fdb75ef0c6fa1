"""Sliding windows of a spyre tensor: the gather behind convolutions and pooling.

``of(x, kernel, stride, dilation, pads, value)`` pads ``x`` [N, C, *S] on the
card (``constant_pad_nd``: a DMA program) and returns its windows as a view
[N, C, *O, *K].  Whoever consumes the windows copies the view once into the
order it needs (an im2col patch matrix; ``taps_first`` for a pooling): that
copy is the gather, a device-to-device copy on the card that moves every
window byte, read and written once, costed by the simulator at the card's
memory bandwidth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def out_size(size: int, k: int, stride: int, dilation: int, lo: int, hi: int) -> int:
    return (size + lo + hi - (k - 1) * dilation - 1) // stride + 1


def of(
    x: torch.Tensor,
    kernel: tuple[int, ...],
    stride: list[int],
    dilation: list[int],
    pads: list[tuple[int, int]],
    value: float,
) -> torch.Tensor:
    """The windows of ``x`` [N, C, *S]: a view [N, C, *O, *K] of the padded input."""
    nd = len(kernel)
    flat = [p for lo_hi in reversed(pads) for p in lo_hi]  # F.pad: last dim first
    if any(flat):
        x = F.pad(x, flat, value=value)
    for i in range(nd):
        span = (kernel[i] - 1) * dilation[i] + 1
        x = x.unfold(2 + i, span, stride[i])
        if dilation[i] > 1:
            x = x[..., :: dilation[i]]
    return x


def taps_first(win: torch.Tensor, nd: int) -> torch.Tensor:
    """Windows [N, C, *O, *K] copied once into a new [prod(K), N, C, *O] (the
    gather): the taps lead, so the output's last dim stays the stick dim (taps
    last would pad every few-tap row to a whole stick: 64 lanes for 9 taps of
    fp16) and a pooling reduces over the outer dim."""
    lead = win.dim() - nd
    out = torch.empty((math.prod(win.shape[lead:]), *win.shape[:lead]), dtype=win.dtype,
                      device=win.device)  # fmt: skip
    order = [*range(lead, win.dim()), *range(lead)]
    out.view(*win.shape[lead:], *win.shape[:lead]).copy_(win.permute(order))
    return out
