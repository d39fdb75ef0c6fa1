"""Adapters: ops the card cannot do directly, rewritten into mathematically
equivalent sequences of ops it can (each of which runs as a device kernel).

One registry, ``ADAPTERS``, with the reason for each.  An adapter receives the
aten overload as called (functional, in-place or out=) and returns
NotImplemented for inputs it does not serve (they go on to the next path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_spyre.ops import dispatch


@dataclass(frozen=True)
class Adapter:
    fn: Callable[..., torch.Tensor | tuple | None]
    reason: str


ADAPTERS: dict[str, Adapter] = {}


def adapter(*names: str, reason: str):
    def wrap(fn):
        for name in names:
            ADAPTERS[name] = Adapter(fn, reason)
            dispatch.ADAPTERS[name] = _entry(fn)
        return fn

    return wrap


# ----------------------------------------------------------- call plumbing
def _bind(op, args: tuple, kwargs: dict) -> dict:
    """Arguments by schema name."""
    bound = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _written(op) -> list[str]:
    return [
        a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]


def _entry(fn):
    """Run ``fn`` on the functional arguments and honour in-place / out=."""

    def handler(op, args, kwargs):
        bound = _bind(op, args, kwargs)
        targets = _written(op)
        dests = [bound["self"] if t == "self" else bound.pop(t) for t in targets]
        result = fn(op, bound)
        if result is NotImplemented or not dests:
            return result
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(dests):
            return NotImplemented
        for dest, res in zip(dests, results):
            if dest.shape != res.shape:
                dest.resize_(res.shape)
            dest.copy_(res)
        return tuple(dests) if isinstance(result, tuple) else dests[0]

    return handler


def _spyre_float(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == "spyre"
        and x.dtype
        in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        )
    )


# ------------------------------------------------------------ sin and cos
# The vector units evaluate exp/log/tanh/rsqrt natively but have no sine:
# reduce the argument to [-pi, pi] with a two-constant (Cody-Waite) 2*pi,
# then evaluate a Taylor polynomial in Horner form (degree 17/16: error below
# 3e-8 on [-pi, pi], under fp32's resolution there).
_TWO_PI_HI = 6.28125  # exactly representable: k * hi is exact for |k| < 2**16
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI
_SIN = [(-1) ** i / math.factorial(2 * i + 1) for i in range(9)]
_COS = [(-1) ** i / math.factorial(2 * i) for i in range(9)]


def _reduce_2pi(x: torch.Tensor) -> torch.Tensor:
    k = torch.round(x * (1.0 / (2 * math.pi)))
    return (x - k * _TWO_PI_HI) - k * _TWO_PI_LO


def _horner(y2: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    acc = torch.full_like(y2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * y2 + c
    return acc


def _trig(op, bound, cos: bool):
    x = bound["self"]
    if not _spyre_float(x) or x.numel() == 0:
        return NotImplemented
    xf = x.float()
    y = _reduce_2pi(xf)
    y2 = y * y
    out = _horner(y2, _COS) if cos else y * _horner(y2, _SIN)
    return out.to(x.dtype)


@adapter("sin", reason="no sine on the vector units: range reduction + polynomial (mul/add)")
def _sin(op, bound):
    return _trig(op, bound, cos=False)


@adapter("cos", reason="no cosine on the vector units: range reduction + polynomial (mul/add)")
def _cos(op, bound):
    return _trig(op, bound, cos=True)


# -------------------------------------------------------- integer division
# The card divides in floating point only: the quotient is estimated in fp32
# and corrected with exact integer multiply/compare steps (two rounds reach
# the exact quotient for |a| < 2**31).
_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _int_operands(bound):
    a, b = bound["self"], bound["other"]
    if not isinstance(a, torch.Tensor) or a.device.type != "spyre" or a.dtype not in _INTS:
        return None
    if isinstance(b, torch.Tensor):
        if b.dtype not in _INTS or (b.device.type != "spyre" and b.dim() != 0):
            return None
        if b.device.type != "spyre":
            b = b.item()
    elif not isinstance(b, int) or isinstance(b, bool):
        return None
    if isinstance(b, int):
        b = torch.full((), b, dtype=a.dtype, device=a.device)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _check_nonzero(b: torch.Tensor) -> None:
    if bool((b == 0).any()):
        raise RuntimeError("ZeroDivisionError")  # what torch's integer division raises


def _refine(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, rnd) -> torch.Tensor:
    """The fp32 quotient ``q`` of integers made exact to within one: the
    remainder ``a - q * b`` is exact in the integer dtype, and its own fp32
    quotient corrects ``q`` (24 more bits per pass: three passes cover int64;
    an fp32 quotient of a 2**30 dividend is off by up to |a| / |b| * 2**-24)."""
    passes = 3 if a.dtype == torch.int64 else 2
    for _ in range(passes):
        r = a - q * b
        q = q + rnd(r.float() / b.float()).to(a.dtype)
    return q


def _floor_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    q = _refine(a, b, torch.floor(a.float() / b.float()).to(a.dtype), torch.floor)
    for _ in range(2):
        r = a - q * b
        # floor semantics: r has b's sign (or is 0) and |r| < |b|
        too_big = (r != 0) & ((r < 0) != (b < 0))
        q = q - too_big.to(a.dtype)
        r = a - q * b
        too_small = (r != 0) & ((r < 0) == (b < 0)) & (r.abs() >= b.abs())
        q = q + too_small.to(a.dtype)
    return q


def _trunc_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    q = _refine(a, b, torch.trunc(a.float() / b.float()).to(a.dtype), torch.trunc)
    for _ in range(2):
        r = a - q * b
        # trunc semantics: r has a's sign (or is 0) and |r| < |b|
        over = (r != 0) & ((r < 0) != (a < 0))
        q = q - torch.where(over, torch.sign(a) * torch.sign(b), torch.zeros_like(q))
        r = a - q * b
        under = (r.abs() >= b.abs()) & (r != 0)
        q = q + torch.where(under, torch.sign(a) * torch.sign(b), torch.zeros_like(q))
    return q


@adapter("floor_divide", reason="integer division: fp32 quotient + exact integer correction")
def _floor_divide(op, bound):
    ab = _int_operands(bound)
    if ab is None:
        return NotImplemented
    _check_nonzero(ab[1])
    return _floor_div(*ab)


@adapter("div", "true_divide", reason="integer division with rounding: fp32 + correction")
def _div(op, bound):
    mode = bound.get("rounding_mode")
    if mode is None:
        return NotImplemented  # true division of ints is a float op (vector unit)
    ab = _int_operands(bound)
    if ab is None:
        return NotImplemented
    _check_nonzero(ab[1])
    return _floor_div(*ab) if mode == "floor" else _trunc_div(*ab)


def _int_remainder(bound, quotient):
    ab = _int_operands(bound)
    if ab is None:
        return NotImplemented
    _check_nonzero(ab[1])
    a, b = ab
    return a - quotient(a, b) * b


@adapter("remainder", reason="integer remainder: a - b * floor(a / b) with exact correction")
def _remainder(op, bound):
    return _int_remainder(bound, _floor_div)


@adapter("fmod", reason="integer fmod: a - b * trunc(a / b) with exact correction")
def _fmod(op, bound):
    return _int_remainder(bound, _trunc_div)


# --------------------------------------------------------- sorting family
# No sorting unit: the rank of each element is counted with one broadcast
# comparison and a sum (O(n^2) work per row, all on the vector units), then
# the elements are scattered to their ranks.  Rows up to _MAX_SORT elements.
_MAX_SORT = 2048


def _sort_rows(x: torch.Tensor, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted values and indices of ``x`` along its last dim (stable)."""
    n = x.shape[-1]
    xi = x.unsqueeze(-1)  # element i
    xj = x.unsqueeze(-2)  # element j
    nan_i, nan_j = torch.isnan(xi), torch.isnan(xj)
    if descending:  # NaN first, as torch.sort does
        before = (xj > xi) | (nan_j & ~nan_i)
    else:  # NaN last
        before = (xj < xi) | (nan_i & ~nan_j)
    tie = (xj == xi) | (nan_i & nan_j)
    idx = torch.arange(n, device=x.device)
    earlier = idx.view(1, n) < idx.view(n, 1)  # j < i
    rank = (before | (tie & earlier)).sum(-1)
    values = torch.empty_like(x).scatter_(-1, rank, x)
    indices = torch.empty(x.shape, dtype=torch.int64, device=x.device).scatter_(
        -1, rank, idx.expand(x.shape).contiguous()
    )
    return values, indices


def _sortable(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == "spyre"
        and x.dtype != torch.bool
        and x.numel() > 0
    )


def _sort_along(bound, descending_key: str):
    """Sorted values and indices of ``self`` along ``dim``, or None when the
    adapter does not serve the input."""
    x = bound["self"]
    dim = bound.get("dim", -1)
    if not _sortable(x) or x.dim() == 0 or x.shape[dim] > _MAX_SORT:
        return None
    descending = bool(bound.get(descending_key, descending_key == "largest"))
    v, i = _sort_rows(x.movedim(dim, -1), descending)
    return v.movedim(-1, dim), i.movedim(-1, dim)


@adapter("sort", reason="no sorting unit: rank by broadcast comparison + sum, then scatter")
def _sort(op, bound):
    got = _sort_along(bound, "descending")
    return NotImplemented if got is None else got


@adapter("argsort", reason="no sorting unit: rank by broadcast comparison + sum, then scatter")
def _argsort(op, bound):
    got = _sort_along(bound, "descending")
    return NotImplemented if got is None else got[1]


@adapter("topk", reason="no sorting unit: the first k of the comparison-count sort")
def _topk(op, bound):
    dim = bound.get("dim", -1)
    x = bound["self"]
    if not _sortable(x) or x.dim() == 0 or bound["k"] > x.shape[dim]:
        return NotImplemented
    got = _sort_along(bound, "largest")
    if got is None:
        return NotImplemented
    k = bound["k"]
    return tuple(t.narrow(dim, 0, k).contiguous() for t in got)


# ------------------------------------------------ compositions of kernels
# Ops with no kernel of their own whose definition is a short expression in
# ops that have one: they run as those kernels, on the card.
def _spyre(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "spyre"


@adapter("dot", "vdot", "inner", reason="a product with one output: elementwise mul + sum")
def _dot(op, bound):
    a = bound["self"]
    b = bound.get("tensor", bound.get("other"))
    if not (_spyre(a) and _spyre(b)) or a.dim() != 1 or a.shape != b.shape:
        return NotImplemented
    if a.dtype != b.dtype:
        return NotImplemented  # PyTorch's dtype error
    return (a * b).sum()


@adapter("mv", reason="matrix-vector product: mm with a one-column matrix")
def _mv(op, bound):
    m, v = bound["self"], bound["vec"]
    if not (_spyre(m) and _spyre(v)) or m.dim() != 2 or v.dim() != 1:
        return NotImplemented
    return (m @ v.unsqueeze(1)).squeeze(1)


@adapter("addmv", reason="beta * self + alpha * (mat @ vec) through the matmul kernel")
def _addmv(op, bound):
    x, m, v = bound["self"], bound["mat"], bound["vec"]
    if not (_spyre(x) and _spyre(m) and _spyre(v)) or m.dim() != 2 or v.dim() != 1:
        return NotImplemented
    beta, alpha = bound.get("beta", 1), bound.get("alpha", 1)
    prod = (m @ v.unsqueeze(1)).squeeze(1)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod.expand(torch.broadcast_shapes(x.shape, prod.shape)).contiguous()
    return prod + (x * beta if beta != 1 else x)


@adapter("equal", reason="a host bool from one comparison and an all-reduction on the card")
def _equal(op, bound):
    a, b = bound["self"], bound["other"]
    if not (_spyre(a) and _spyre(b)):
        return NotImplemented
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool((a == b).all().item()) if a.numel() else True


@adapter("nansum", reason="sum with NaNs as zeros: where + sum")
def _nansum(op, bound):
    x = bound["self"]
    if not _spyre(x) or bound.get("dtype") is not None:
        return NotImplemented
    clean = torch.where(torch.isnan(x), torch.zeros_like(x), x) if x.is_floating_point() else x
    return clean.sum(bound.get("dim"), keepdim=bool(bound.get("keepdim", False)))


@adapter("count_nonzero", reason="(x != 0) summed")
def _count_nonzero(op, bound):
    x = bound["self"]
    if not _spyre(x):
        return NotImplemented
    dim = bound.get("dim")
    return (x != 0).sum(dim if dim is not None else ()).to(torch.int64)


@adapter("logsumexp", reason="max + log(sum(exp(x - max))): the stable form, in kernels")
def _logsumexp(op, bound):
    x = bound["self"]
    if not _spyre_float(x) or x.numel() == 0:
        return NotImplemented
    dim = bound["dim"]
    keepdim = bool(bound.get("keepdim", False))
    m = x.amax(dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    out = (x - m).exp().sum(dim, keepdim=True).log() + m
    if not keepdim:
        dims = [dim] if isinstance(dim, int) else list(dim)
        out = out.squeeze(dims) if dims else out.squeeze()
    return out


@adapter("log_sigmoid_forward", reason="log(sigmoid(x)) = -softplus(-x), one kernel")
def _log_sigmoid(op, bound):
    x = bound["self"]
    if not _spyre_float(x):
        return NotImplemented
    # the second output is a CPU-kernel scratch buffer for the backward pass
    return -torch.nn.functional.softplus(-x), torch.empty(0, dtype=x.dtype, device=x.device)
