"""Convolutions on the card.

PyTorch routes convolutions of out-of-tree devices to
``convolution_overrideable``.  The one transformers' decoders use is the
causal depthwise conv1d of Mamba-2 layers (``nn.Conv1d(groups=channels)``,
kernel 4, padding 3, then sliced to the sequence; decode steps run it with
padding 0 on the cached window): it runs as ``kernels.ssm.depthwise_conv1d``.
The input is made time-major and zero-padded (one DMA pass, channels
become the stick dim so the taps are row shifts), the weights are laid out
tap-major ([K, C], a few KB); the program stores the result in the
convolution's own [B, C, T] layout.

Every other convolution still takes the host fallback (counted, warned).
"""

from __future__ import annotations

import torch

from torch_spyre.ops.registry import kernel
from torch_spyre.runtime import cards, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _depthwise_1d(x, weight, bias, stride, padding, dilation, transposed, groups):
    """The depthwise conv1d kernel, or None when the call is another convolution."""
    from torch_spyre.kernels import ssm

    if x.dim() == 4 and weight.dim() == 4 and x.shape[2] == 1 and weight.shape[2] == 1:
        # PyTorch runs conv1d as a conv2d of height 1 on this dispatch key
        if tuple(stride)[:1] != (1,) or tuple(dilation)[:1] != (1,) or tuple(padding)[:1] != (0,):
            return None
        out = _depthwise_1d(
            x.squeeze(2), weight.squeeze(2), bias, stride[1:], padding[1:], dilation[1:],
            transposed, groups,
        )  # fmt: skip
        return None if out is None else out.unsqueeze(2)
    if transposed or x.dim() != 3 or weight.dim() != 3 or x.dtype not in _FLOATS:
        return None
    b, c, t = x.shape
    if groups != c or weight.shape[:2] != (c, 1) or weight.dtype != x.dtype:
        return None
    if tuple(stride) != (1,) or tuple(dilation) != (1,) or len(padding) != 1:
        return None
    if bias is not None and (bias.shape != (c,) or bias.dtype != x.dtype):
        return None
    k, p = weight.shape[2], int(padding[0])
    t_out = t + 2 * p - k + 1
    if t_out <= 0:
        return None
    xt = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, p, p))  # [b, t + 2p, c]
    taps = weight.reshape(c, k).t().contiguous()  # [k, c]
    key = ("conv1d_dw", b, t_out, c, k, x.dtype, bias is not None)
    dev = x.device

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            ssm.depthwise_conv1d(b, t_out, c, k, x.dtype, bias=bias is not None, config=cfg)
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return None
    out = torch.empty((b, c, t_out), dtype=x.dtype, device=dev)
    bind = {"x": operands.whole(xt), "w": operands.whole(taps), "out": out}
    if bias is not None:
        bind["bias"] = operands.whole(bias)
    kern.launch(bind)
    return out


# PyTorch runs the convolutions of out-of-tree devices as convolution_overrideable,
# which has no CPU kernel: what the card does not serve runs aten.convolution on
# the host (counted as a fallback)
@kernel("convolution_overrideable.default", fallback=torch.ops.aten.convolution.default)
def _convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    out = _depthwise_1d(input, weight, bias, stride, padding, dilation, transposed, groups)
    if out is not None:
        return out
    from torch_spyre.runtime.fallback import host_fallback

    out = host_fallback(
        torch.ops.aten.convolution.default,
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
    )  # fmt: skip
    return _in_fake_layout(out, input, weight, bias, stride, padding, dilation, transposed,
                           output_padding, groups)  # fmt: skip


def _in_fake_layout(out, input, weight, bias, stride, padding, dilation, transposed,
                    output_padding, groups):  # fmt: skip
    """``out`` in the memory format FakeTensor gives a convolution on this
    device (``torch._subclasses.fake_impls.conv``: the backend's choice; the
    host kernel may pick channels-last for a permuted input): a compiled
    graph asserts the output's strides against it."""
    backend = torch._C._select_conv_backend(
        input, weight, stride=stride, padding=padding, dilation=dilation,
        transposed=transposed, output_padding=output_padding, groups=groups, bias=bias,
    )  # fmt: skip
    x, w = input, weight
    if weight.dim() == 3:
        x, w = input.contiguous().unsqueeze(2), weight.unsqueeze(2)
    fmt = torch._C._conv_determine_backend_memory_format(x, w, backend)
    if out.dim() == 3 and fmt == torch.channels_last:
        return out.unsqueeze(2).contiguous(memory_format=fmt).squeeze(2)
    return out.contiguous(memory_format=fmt)
