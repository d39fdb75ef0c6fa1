"""Sliding windows of a spyre tensor: the gather behind convolutions and pooling.

``of(x, kernel, stride, dilation, pads, value)`` pads ``x`` [N, C, *S] on the
card (``constant_pad_nd``: a DMA program) and returns its windows as a view
[N, C, *O, *K].  Whoever consumes the windows in another order (an im2col
patch matrix, a pooling reduction over the last dim) reshapes the view: that
copy is the gather, a DMA program on the card that moves every window byte
(``ops.movement``: its modelled time is that of the bytes it moves, read and
written once, costed by the simulator).
"""

from __future__ import annotations

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


def flat(win: torch.Tensor, nd: int) -> torch.Tensor:
    """Windows [N, C, *O, *K] as [N, C, *O, prod(K)] (the gather, when a copy)."""
    return win.reshape(*win.shape[: win.dim() - nd], -1)
