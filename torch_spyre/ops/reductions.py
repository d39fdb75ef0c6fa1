"""Reductions (sum, mean, amax/amin, max/min with indices, argmax, prod,
var/std, any/all) as kernel programs: one Reduce along one dim.

Several dims are first brought together (permute + flatten, a re-layout on
the card) so one program reduces them as one dim.
"""

from __future__ import annotations

import math

import torch

from torch_spyre.ir import vector_ops as sim_ops
from torch_spyre.kernels import eager as programs
from torch_spyre.ops.registry import NoKernel, kernel, out_variant
from torch_spyre.runtime import launch, operands

# name -> (fn(x, dim), identity for padding uneven core splits, combinable)
_REDUCTIONS = {
    "sum": (lambda x, d: x.sum(d), 0.0, True),
    "prod": (lambda x, d: x.prod(d), 1.0, True),
    "amax": (lambda x, d: x.amax(d), -math.inf, True),
    "amin": (lambda x, d: x.amin(d), math.inf, True),
    "any": (lambda x, d: x.any(d), 0.0, True),
    "all": (lambda x, d: x.all(d), 1.0, True),
    "argmax": (lambda x, d: x.argmax(d), -math.inf, False),
    "argmin": (lambda x, d: x.argmin(d), math.inf, False),
}


def _reduction_op(name: str, correction: float | None = None) -> str:
    """The sim reduction for ``name`` (var/std carry their correction, norm its order)."""
    if name == "norm":
        key = f"aten.norm[{correction}]"
        if key not in sim_ops.REDUCTIONS:
            sim_ops.register_reduction(
                key, lambda x, d: torch.linalg.vector_norm(x, correction, dim=d), 0.0
            )
        return key
    if name in ("var", "std"):
        key = f"aten.{name}[{correction}]"
        if key not in sim_ops.REDUCTIONS:
            if name == "var":
                sim_ops.register_reduction(key, lambda x, d: x.var(d, correction=correction), 0.0)
            else:
                sim_ops.register_reduction(key, lambda x, d: x.std(d, correction=correction), 0.0)
        return key
    key = f"aten.{name}"
    if key not in sim_ops.REDUCTIONS:
        fn, identity, _ = _REDUCTIONS[name]
        sim_ops.register_reduction(key, fn, identity)
    return key


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({d % max(x.dim(), 1) for d in dim})


def reduce(
    x: torch.Tensor,
    name: str,
    dim,
    keepdim: bool,
    out_dtype: torch.dtype,
    correction: float | None = None,
    scale_by_count: bool = False,
) -> torch.Tensor:
    """``name`` over ``dim`` of spyre tensor ``x`` as one kernel."""
    dims = _dims(x, dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    out_shape = (
        [1 if d in dims else s for d, s in enumerate(x.shape)]
        if keepdim
        else [x.shape[d] for d in kept]
    )
    count = math.prod(x.shape[d] for d in dims) if x.dim() else 1
    if x.numel() == 0 or count == 0:
        return _empty_reduction(name, out_shape, out_dtype, x.device)
    if x.dim() == 0:
        src, rdim = x.reshape(1), 0
    elif len(dims) == 1:
        src, rdim = x, dims[0]
    else:
        moved = x.permute(kept + dims)
        src = moved.reshape([x.shape[d] for d in kept] + [count])
        rdim = len(kept)
    src = operands.whole(src)
    combinable = name not in ("var", "std", "argmax", "argmin", "norm")
    op = _reduction_op(name, correction)
    post = 1.0 / count if scale_by_count else None
    key = ("red", op, tuple(src.shape), rdim, src.dtype, out_dtype, post)

    def build() -> launch.Kernel:
        return launch.Kernel(
            programs.reduction(
                op,
                tuple(src.shape),
                rdim,
                src.dtype,
                out_dtype,
                combinable,
                post_scale=post,
                name=f"{name}_{'x'.join(map(str, src.shape))}_dim{rdim}",
            )
        )

    k = launch.kernel(key, build)
    if k.program is None:
        raise NoKernel
    kept_shape = [s for i, s in enumerate(src.shape) if i != rdim]
    out = torch.empty(kept_shape, dtype=out_dtype, device=x.device)
    k.launch({"x": src, "out": out})
    return out.view(out_shape)


# What a reduction over no elements gives (PyTorch's identities); the others
# (amax, argmax, ...) have none and PyTorch raises before reaching a kernel.
_EMPTY_VALUE = {
    "sum": 0,
    "prod": 1,
    "any": False,
    "all": True,
    "var": math.nan,
    "std": math.nan,
    "norm": 0,
}


def _empty_reduction(name, out_shape, out_dtype, device) -> torch.Tensor:
    """The result of reducing no elements (or of reducing an empty tensor)."""
    if math.prod(out_shape) == 0:
        return torch.empty(out_shape, dtype=out_dtype, device=device)
    if name not in _EMPTY_VALUE:
        raise NoKernel
    return torch.full(out_shape, _EMPTY_VALUE[name], dtype=out_dtype, device=device)


def _float_out(x: torch.Tensor, dtype) -> torch.dtype:
    if dtype is not None:
        return dtype
    if x.dtype.is_floating_point:
        return x.dtype
    return torch.int64


@kernel("sum.dim_IntList")
def _sum(x, dim, keepdim=False, dtype=None):
    if dtype is not None and dtype != _float_out(x, None) and x.dtype.is_floating_point:
        return NotImplemented
    return reduce(x, "sum", dim, keepdim, _float_out(x, dtype))


@kernel("sum.default")
def _sum_all(x, dtype=None):
    return _sum(x, None, False, dtype)


@kernel("mean.dim")
def _mean(x, dim, keepdim=False, dtype=None):
    if not (dtype or x.dtype).is_floating_point:
        return NotImplemented
    if dtype is not None and dtype != x.dtype:
        return NotImplemented
    dims = _dims(x, dim)
    if x.numel() == 0 or (x.dim() and math.prod(x.shape[d] for d in dims) == 0):
        shape = (
            [1 if d in dims else n for d, n in enumerate(x.shape)]
            if keepdim
            else [n for d, n in enumerate(x.shape) if d not in dims]
        )
        return torch.full(shape, math.nan, dtype=x.dtype, device=x.device)
    return reduce(x, "sum", dim, keepdim, x.dtype, scale_by_count=True)


@kernel("mean.default")
def _mean_all(x, dtype=None):
    return _mean(x, None, False, dtype)


@kernel("amax.default")
def _amax(x, dim=(), keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented
    return reduce(x, "amax", dim, keepdim, x.dtype)


@kernel("amin.default")
def _amin(x, dim=(), keepdim=False):
    if x.dtype == torch.bool:
        return NotImplemented
    return reduce(x, "amin", dim, keepdim, x.dtype)


def _arg_reduce(name: str):
    def fn(x, dim=None, keepdim=False):
        if dim is None:  # over the flattened tensor
            flat = reduce(x.reshape(-1), name, 0, False, torch.int64)
            return flat.view([1] * x.dim() if keepdim else [])
        return reduce(x, name, dim, keepdim, torch.int64)

    return fn


kernel("argmax.default")(_arg_reduce("argmax"))
kernel("argmin.default")(_arg_reduce("argmin"))


def _value_and_index(value: str, index: str):
    def fn(x, dim, keepdim=False):
        if x.dtype == torch.bool:
            return NotImplemented
        return (
            reduce(x, value, dim, keepdim, x.dtype),
            reduce(x, index, dim, keepdim, torch.int64),
        )

    return fn


kernel("max.dim")(_value_and_index("amax", "argmax"))
kernel("min.dim")(_value_and_index("amin", "argmin"))


def _whole(value: str):
    def fn(x):
        if x.numel() == 0 or x.dtype == torch.bool:
            return NotImplemented
        return reduce(x, value, None, False, x.dtype)

    return fn


kernel("max.default")(_whole("amax"))
kernel("min.default")(_whole("amin"))


@kernel("prod.dim_int")
def _prod(x, dim, keepdim=False, dtype=None):
    if dtype is not None and dtype != _float_out(x, None):
        return NotImplemented
    return reduce(x, "prod", dim, keepdim, _float_out(x, dtype))


@kernel("prod.default")
def _prod_all(x, dtype=None):
    return _prod(x, None, False, dtype)


@kernel("var.correction")
def _var(x, dim=None, *, correction=None, keepdim=False):
    if not x.dtype.is_floating_point:
        return NotImplemented
    c = 1.0 if correction is None else float(correction)
    return reduce(x, "var", dim, keepdim, x.dtype, correction=c)


@kernel("std.correction")
def _std(x, dim=None, *, correction=None, keepdim=False):
    if not x.dtype.is_floating_point:
        return NotImplemented
    c = 1.0 if correction is None else float(correction)
    return reduce(x, "std", dim, keepdim, x.dtype, correction=c)


def _bool_reduce(name):
    def fn(x, dim=None, keepdim=False):
        out_dtype = torch.uint8 if x.dtype == torch.uint8 else torch.bool
        return reduce(x, name, dim, keepdim, out_dtype)

    return fn


kernel("any.dim", "any.dims", "any.default")(_bool_reduce("any"))
kernel("all.dim", "all.dims", "all.default")(_bool_reduce("all"))


@kernel("linalg_vector_norm.default")
def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if not x.dtype.is_floating_point or (dtype is not None and dtype != x.dtype):
        return NotImplemented
    return reduce(x, "norm", dim, keepdim, x.dtype, correction=float(ord))


# out= forms of the reductions above
for _name, _fn in (
    ("sum.IntList_out", _sum),
    ("mean.out", _mean),
    ("amax.out", _amax),
    ("amin.out", _amin),
    ("prod.int_out", _prod),
    ("var.correction_out", _var),
    ("std.correction_out", _std),
    ("linalg_vector_norm.out", _vector_norm),
):
    kernel(_name)(out_variant(_fn))


@kernel("var_mean.correction")
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction=correction, keepdim=keepdim), _mean(x, dim, keepdim)


@kernel("std_mean.correction")
def _std_mean(x, dim=None, *, correction=None, keepdim=False):
    return _std(x, dim, correction=correction, keepdim=keepdim), _mean(x, dim, keepdim)


@kernel("aminmax.default")
def _aminmax(x, *, dim=None, keepdim=False):
    if x.dtype == torch.bool or x.numel() == 0:
        return NotImplemented
    return _amin(x, () if dim is None else dim, keepdim), _amax(
        x, () if dim is None else dim, keepdim
    )


@kernel("norm.out")
def _norm_out(x, p, dim, keepdim=False, *, out):
    return out_variant(_vector_norm)(x, 2 if p is None else p, dim, keepdim, out=out)
