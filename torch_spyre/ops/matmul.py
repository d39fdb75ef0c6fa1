"""The matmul family (mm, bmm, addmm, baddbmm; linear and matmul decompose to
them) as PE-array kernel programs.

Operands are used where they lie: a transposed weight (``w.t()``) is read as
the weight itself indexed (n, k), and a 2-D view of a whole N-D activation is
read in its own shape, so neither costs a re-layout.
"""

from __future__ import annotations

import torch

from torch_spyre.kernels import eager as programs
from torch_spyre.ops.registry import kernel, out_variant
from torch_spyre.runtime import launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _lhs(a: torch.Tensor, batch: list[str]) -> tuple[torch.Tensor, tuple[str, ...], dict]:
    """Operand and index for the left factor [*batch, M, K]."""
    base = operands.base_of(a)
    if base is not None and base.dim() >= 1 and base.shape[-1] == a.shape[-1] and not batch:
        rows = [f"m{i}" for i in range(base.dim() - 1)] or []
        sizes = {r: base.shape[i] for i, r in enumerate(rows)}
        if not rows:  # a 1-D base: one row
            return base.view(1, -1), ("m0", "k"), {"m0": 1}
        return base, (*rows, "k"), sizes
    if batch:
        t = operands.whole(a) if operands.base_of(a) is None or a.mT.is_contiguous() else a
        tt = a.mT
        if operands.is_whole_default(tt):
            return tt, (*batch, "k", "m0"), {"m0": a.shape[-2]}
        t = operands.whole(a)
        return t, (*batch, "m0", "k"), {"m0": a.shape[-2]}
    tt = a.t()
    if operands.is_whole_default(tt):
        return tt, ("k", "m0"), {"m0": a.shape[0]}
    return operands.whole(a), ("m0", "k"), {"m0": a.shape[0]}


def _rhs(b: torch.Tensor, batch: list[str]) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Operand and index for the right factor [*batch, K, N]."""
    tt = b.mT
    if operands.is_whole_default(tt):
        return tt, (*batch, "n", "k")
    return operands.whole(b), (*batch, "k", "n")


def _bias(bias: torch.Tensor, rows: list[str], n: int, m: int):
    """Bias operand and index, broadcast to the [rows..., n] output.

    A vector bias indexes n; a [m, n] bias is served when the rows are one dim.
    """
    t = operands.whole(bias)
    if bias.dim() <= 1:
        size = bias.shape[0] if bias.dim() else 1
        return (t.reshape(1), (None,)) if size == 1 else (t, ("n",)) if size == n else None
    if bias.dim() == 2 and len(rows) == 1:
        index = tuple(
            name if s == full else None if s == 1 else "bad"
            for name, s, full in zip(("m0", "n"), bias.shape, (m, n))
        )
        return None if "bad" in index else (t, index)
    return None


def _empty_product(out_shape, a, bias, alpha, beta):
    """A product with no terms (k = 0) is zero; one with no rows or columns is empty."""
    out = torch.zeros(out_shape, dtype=a.dtype, device=a.device)
    if bias is not None and out.numel():
        out = out + bias * beta if beta != 1 else out + bias
    return out


def matmul(a, b, bias=None, alpha=1.0, beta=1.0):
    if a.dtype not in _FLOATS or b.dtype != a.dtype or (bias is not None and bias.dtype != a.dtype):
        return NotImplemented
    batched = a.dim() == 3
    if batched and (b.dim() != 3 or a.shape[0] != b.shape[0]):
        return NotImplemented
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    if b.shape[-2] != k:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({'x'.join(map(str, a.shape))} and "
            f"{'x'.join(map(str, b.shape))})"
        )
    out_shape = (*a.shape[:-2], m, n)
    if a.numel() == 0 or b.numel() == 0:
        return _empty_product(out_shape, a, bias, alpha, beta)
    batch = ["b0"] if batched else []
    a_t, a_index, rows = _lhs(a, batch)
    b_t, b_index = _rhs(b, batch)
    sizes = {**({"b0": a.shape[0]} if batched else {}), **rows, "n": n, "k": k}
    out_rows = list(rows)
    out_base_shape = (*(a.shape[:1] if batched else ()), *rows.values(), n)
    bias_arg = None
    if bias is not None:
        if batched:
            return NotImplemented  # baddbmm with a bias: the host fallback
        got = _bias(bias, out_rows, n, m)
        if got is None:
            return NotImplemented
        bias_arg = got
    key = (
        "mm",
        a.dtype,
        tuple(a_t.shape),
        a_index,
        tuple(b_t.shape),
        b_index,
        tuple(sorted(sizes.items())),
        None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
        alpha,
        beta,
    )

    def build() -> launch.Kernel:
        return launch.Kernel(
            programs.matmul(
                tuple(a_t.shape),
                a_index,
                tuple(b_t.shape),
                b_index,
                out_base_shape,
                (*batch, *out_rows, "n"),
                sizes,
                a.dtype,
                bias=None if bias_arg is None else (tuple(bias_arg[0].shape), bias_arg[1]),
                alpha=alpha,
                beta=beta,
                name=f"{'addmm' if bias is not None else 'mm'}_{'x'.join(map(str, out_shape))}x{k}",
            )
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return NotImplemented
    out = torch.empty(out_base_shape, dtype=a.dtype, device=a.device)
    bind = {"a": a_t, "b": b_t, "out": out}
    if bias_arg is not None:
        bind["bias"] = bias_arg[0]
    kern.launch(bind)
    return out.view(out_shape)


@kernel("mm.default")
def _mm(a, b):
    return matmul(a, b)


# ``torch.mm(a, b, out=view)``: transformers' grouped-matmul fallback writes each
# group's product into a row slice of its output
kernel("mm.out")(out_variant(_mm))


@kernel("bmm.default")
def _bmm(a, b):
    return matmul(a, b)


@kernel("addmm.default")
def _addmm(bias, a, b, *, beta=1, alpha=1):
    return matmul(a, b, bias, float(alpha), float(beta))


@kernel("baddbmm.default")
def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    if beta == 0:
        return matmul(a, b, None, float(alpha))
    out = matmul(a, b, bias, float(alpha), float(beta))
    if out is NotImplemented and a.dim() == 3 and a.dtype == torch.float32:
        # a batched bias (attention's mask): the product's program, then one
        # pointwise add of the scaled bias.  fp32 only: in 16 bits the product
        # would be rounded before the add (two roundings where PyTorch has
        # one), and attention logits of a few hundred lose the softmax's
        # precision (OpInfo's fp16 multi_head_attention_forward sample 134)
        out = matmul(a, b, None, float(alpha))
        if out is not NotImplemented:
            out = out + (bias if beta == 1 else bias * beta)
    return out


# the ``out=`` forms Inductor's extern kernels call when the compiler leaves a
# matmul to the eager library
kernel("bmm.out")(out_variant(_bmm))
kernel("addmm.out")(out_variant(_addmm))
kernel("baddbmm.out")(out_variant(_baddbmm))


# Convolutions: ops/conv.py (the depthwise conv1d of Mamba layers runs on the
# card, others take the host fallback); their gradients take it too.
@kernel("convolution_backward_overrideable.default")
def _convolution_backward(
    grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
    output_mask,
):  # fmt: skip
    from torch_spyre.runtime.fallback import host_fallback

    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return host_fallback(
        torch.ops.aten.convolution_backward.default,
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        output_padding, groups, output_mask,
    )  # fmt: skip
