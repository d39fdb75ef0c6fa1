"""Convolutions on the card.

PyTorch routes convolutions of out-of-tree devices to
``convolution_overrideable``.  Two programs serve them:

* The causal depthwise conv1d of Mamba-2 layers (``nn.Conv1d(groups=channels)``,
  kernel 4, padding 3) runs as ``kernels.ssm.depthwise_conv1d``: the input is
  made time-major and zero-padded (one DMA pass, channels become the stick
  dim so the taps are row shifts), the weights tap-major ([K, C], a few KB).
* Every other convolution, 1-3d, grouped, strided, padded, dilated and
  transposed, is an im2col GEMM on the PE array (``im2col_conv``): the padded
  input's windows are gathered on the card into a patch matrix
  [groups, C/groups * prod(K), N * prod(O)] (a device-to-device copy that moves
  every patch byte, costed by the simulator: ``ops.windows``), then one matmul program per call multiplies
  the weights [groups, Cout/groups, C/groups * prod(K)] into it, with the
  bias fused into the matmul when there is one group.  A transposed
  convolution is the convolution of its input spread by the stride (zeros
  between the samples) and padded by ``dilation * (k - 1) - padding``, with
  the weights' in/out channels swapped and their taps flipped.
"""

from __future__ import annotations

import math

import torch

from torch_spyre.ops import matmul, windows
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


def _as_transposed(x, weight, stride, padding, dilation, output_padding, groups):
    """The plain convolution a transposed one is: (input, weight, padding)."""
    nd = x.dim() - 2
    spatial = x.shape[2:]
    if any(s > 1 for s in stride):
        spread = [(n - 1) * s + 1 for n, s in zip(spatial, stride)]
        xs = torch.zeros((*x.shape[:2], *spread), dtype=x.dtype, device=x.device)
        xs[(slice(None), slice(None), *(slice(None, None, s) for s in stride))] = x
        x = xs
    k = weight.shape[2:]
    pads = []
    for i in range(nd):
        edge = dilation[i] * (k[i] - 1) - padding[i]
        pads.append((edge, edge + output_padding[i]))
    cin, cout_g = weight.shape[:2]
    w = weight.reshape(groups, cin // groups, cout_g, *k).transpose(1, 2)
    w = w.reshape(groups * cout_g, cin // groups, *k).flip(list(range(2, 2 + nd)))
    return x, w, pads


def _gather(view: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The windows ``view`` copied once into a new [*shape] patch matrix (a
    reshape would first make the view contiguous in its own shape, whose
    sticks differ, then re-lay that: two passes)."""
    out = torch.empty(shape, dtype=view.dtype, device=view.device)
    out.view(view.shape).copy_(view)
    return out


def im2col_conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The convolution as a window gather and one matmul program (None: not served)."""
    nd = x.dim() - 2
    if nd < 1 or nd > 3 or weight.dim() != nd + 2 or x.dtype not in _FLOATS:
        return None
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return None
    stride, padding, dilation = (list(map(int, v)) for v in (stride, padding, dilation))
    if transposed:
        x, weight, pads = _as_transposed(
            x, weight, stride, padding, dilation, list(map(int, output_padding)), groups
        )
        stride = [1] * nd
    else:
        pads = [(p, p) for p in padding]
    n, c = x.shape[:2]
    cout, k = weight.shape[0], tuple(weight.shape[2:])
    if c % groups or cout % groups or weight.shape[1] != c // groups:
        return None
    span = [(kk - 1) * d + 1 for kk, d in zip(k, dilation)]
    sizes = [s + lo + hi for s, (lo, hi) in zip(x.shape[2:], pads)]
    if any(sz < sp for sz, sp in zip(sizes, span)):
        return None  # an empty output: PyTorch's error, from the host
    o = [(sz - sp) // s + 1 for sz, sp, s in zip(sizes, span, stride)]
    out_shape = (n, cout, *o)
    if x.numel() == 0 or weight.numel() == 0:
        out = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
        return out if bias is None else out + bias.reshape(cout, *([1] * nd))
    # [N, C, *O, *K] windows, gathered as [groups, C/g * K, N * O] (one copy on the card)
    win = windows.of(x, k, stride, dilation, pads, 0.0)
    order = [1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd)]
    kk, oo = math.prod(k), math.prod(o)
    if groups == 1:  # 2-D operands: the matmul reads them where they lie
        patches = _gather(win.permute(order), (c * kk, n * oo))
        w = weight.reshape(cout, c * kk)
        y = NotImplemented
        if bias is not None:  # the bias rides in the matmul program when it can
            y = matmul.matmul(w, patches, bias.reshape(cout, 1))
            if y is NotImplemented:
                y = torch.mm(w, patches) + bias.reshape(cout, 1)
        else:
            y = torch.mm(w, patches)
    else:
        patches = _gather(win.permute(order), (groups, (c // groups) * kk, n * oo))
        w = weight.reshape(groups, cout // groups, (c // groups) * kk)
        y = torch.bmm(w, patches).view(groups, cout // groups, n, oo)
        y = y.reshape(cout, n, oo)
        if bias is not None:
            y = y + bias.reshape(cout, 1, 1)
    y = y.reshape(cout, n, *o)
    return y.transpose(0, 1) if n == 1 else y.transpose(0, 1).contiguous()


# PyTorch runs the convolutions of out-of-tree devices as convolution_overrideable,
# which has no CPU kernel: what the card does not serve runs aten.convolution on
# the host (counted as a fallback)
@kernel("convolution_overrideable.default", fallback=torch.ops.aten.convolution.default)
def _convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    out = _depthwise_1d(input, weight, bias, stride, padding, dilation, transposed, groups)
    if out is None:
        out = im2col_conv(
            input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
    if out is None:
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
