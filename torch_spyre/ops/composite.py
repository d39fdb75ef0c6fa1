"""Composite aten ops whose implementation assumes the CPU for any tensor that
is not on CUDA, served before that assumption reaches a spyre tensor.

A ``CompositeImplicitAutograd`` op runs its C++ body on whatever device its
tensors are on.  A few of those bodies branch on ``is_cuda()`` and otherwise
take the CPU's choices, which the card cannot honour:

* ``_batch_norm_impl_index`` (every ``F.batch_norm``) on an empty input
  allocates its saved statistics in the *CPU's* accumulation type of float,
  float64, which the card does not store.  The card's accumulation type is
  fp32 (docs/hardware.md, "dtypes"); an empty batch gets fp32 statistics.
  Any other input takes the composite body unchanged.

* ``max_pool1d/2d/3d`` (``F.max_poolNd`` without indices) call
  ``max_poolNd_with_indices`` on every device but the CPU and drop the
  indices: on the card, an argmax program and an index gather for nothing.
  Without gradients the card computes the values alone
  (``ops.pooling.max_values``); with them, the composite body runs.

They are registered for the PrivateUse1 key and its autograd key,
calling the composite body (``op.decompose``) wherever it does not step in,
so autograd through it is what the composite gives.
"""

from __future__ import annotations

import torch

from torch_spyre.runtime import dispatch_stats

_libs: list[torch.library.Library] = []


def _batch_norm_impl_index(input, weight, bias, running_mean, running_var, training, *rest):
    op = torch.ops.aten._batch_norm_impl_index.default
    if input.device.type != "spyre" or input.numel() != 0:
        return op.decompose(input, weight, bias, running_mean, running_var, training, *rest)
    # ATen's own empty-input branch, with fp32 statistics
    c = input.shape[1] if input.dim() > 1 else 1
    f32 = {"dtype": torch.float32, "device": input.device}
    out = input.clone()
    if weight is not None:
        out = out * weight[0]
    if bias is not None:
        out = out + bias[0]
    dispatch_stats.record("kernel", "_batch_norm_impl_index")
    return (
        out,
        torch.empty(c, **f32),
        torch.empty(c, **f32),
        torch.empty(0, dtype=torch.uint8, device=input.device),
        0,
    )


def _max_pool(nd: int):
    op = getattr(torch.ops.aten, f"max_pool{nd}d").default

    def impl(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        args = (x, kernel_size, stride, padding, dilation, ceil_mode)
        # a plain tensor: under tracing (fake or functional tensors) the graph
        # keeps max_poolNd_with_indices, which the compiler routes itself
        eager = type(x) is torch.Tensor and x.device.type == "spyre"
        if eager and not (torch.is_grad_enabled() and x.requires_grad):
            from torch_spyre.ops import pooling

            out = pooling.max_values(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
            if out is not None:
                dispatch_stats.record("kernel", f"max_pool{nd}d")
                return out
        return op.decompose(*args)

    return impl


def register() -> None:
    if _libs:
        return
    from torch_spyre.runtime.registration import entry

    lib = torch.library.Library("aten", "IMPL")
    for key in ("PrivateUse1", "AutogradPrivateUse1"):
        lib.impl("_batch_norm_impl_index", entry(_batch_norm_impl_index), key)
        for nd in (1, 2, 3):
            lib.impl(f"max_pool{nd}d", entry(_max_pool(nd)), key)
    _libs.append(lib)
