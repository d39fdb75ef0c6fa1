"""Convolutions in compiled graphs: the eager device program, through a custom op.

A spyre convolution in the post-grad graph becomes ``spyre::convolution``, a
custom op running the eager device program (``ops/conv.py``: the window
gather and one matmul program, the bias fused in it), counted as
``kernel``.  Left as ``aten.convolution``, Inductor lowers it as its GPU path
does:

* ``GraphLowering.decide_layout_opt`` turns a graph with convolutions
  channels-last, which on spyre is two whole re-layout programs per
  convolution (its input and its weights), and
* the bias is split out of the convolution into the next pointwise kernel.

Measured on a fp16 conv (64 -> 64 channels, 3 x 3, 56 x 56) + BatchNorm2d
(eval) + ReLU block: 208.5 us modelled through ``aten.convolution``, 135.7 us
through the route.  The batch norm and the activation are then one pointwise
program after the convolution (one pass over its output).

Batch norm is not folded into the weights at run time: measured on the same
block, rescaling the weights [64, 64, 3, 3] each call is a 29.1 us program
(their 3-wide last dim fills a 64-element stick each row), against no pass
saved (the ReLU still reads and writes the output): 166.4 us.  A frozen
graph (``torch._inductor.config.freezing = True``) folds it at compile time
(Inductor's own freezing passes, the weights constants), though it measured
161.2 us: one more device copy, not investigated.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("spyre::convolution", mutates_args=())
def convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> torch.Tensor:
    """``aten.convolution`` by the eager device program (``ops/conv.py``)."""
    return torch.ops.aten.convolution.default(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    ).contiguous()


@convolution.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return torch.ops.aten.convolution.default(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    ).contiguous()


def _ints(v) -> list[int]:
    return [int(a) for a in v]


def route_convolution(n: torch.fx.Node):
    """``aten.convolution`` -> ``spyre::convolution`` (the post-grad pass's route)."""
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = n.args
    return torch.ops.spyre.convolution.default, (
        x, w, b, _ints(stride), _ints(padding), _ints(dilation), bool(transposed),
        _ints(output_padding), int(groups),
    )  # fmt: skip


#: aten op -> route(node) -> (custom op, args)
ROUTES = {torch.ops.aten.convolution.default: route_convolution}

__all__ = ["ROUTES", "convolution"]
