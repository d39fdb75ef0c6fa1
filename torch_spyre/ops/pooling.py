"""Pooling 1-3d on the card: max (with indices), average, adaptive average and
max, fractional max; LP pooling and local response norm are PyTorch
composites over these.

A pooling with fixed windows (max, average) gathers the padded input's
windows on the card (``ops.windows``: one device-to-device copy moving every
window byte) as [prod(K), N, C, *O] and reduces the taps in one reduction
program: ``max`` with its in-window argmax for max pooling, ``sum`` for
average pooling, divided by the per-position window count (a constant of the
pooling's geometry, [*O], computed from the shapes once and cached).  The
flat input index a max pool returns is the argmax gathered from the same
windows of the index map ``arange(prod(S))`` (padded with -1).

Adaptive and fractional pools have windows of varying size.  They are
separable (a box's max is the max over one dim of the maxima over the
others), so each spatial dim is pooled in turn, last to first: the input's
samples of each window are selected along that dim (``index_select`` /
``gather``, a DMA program; a short window repeats its last sample, which
changes no max) and reduced.  Last to first keeps PyTorch's tie rule: the
first maximum in raster order.  Adaptive average pooling is linear: it is a
matmul per dim with the [S, O] averaging matrix (or a mean when O = 1, a
strided average pool when O divides S).
"""

from __future__ import annotations

import math

import torch

from torch_spyre.ops import windows
from torch_spyre.ops.registry import kernel, out_variant
from torch_spyre.runtime import cards

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: constants of pooling geometries (window counts, sample indices, averaging
#: matrices) on the card, by shapes and device; rebuilt cards drop them
_consts: dict = {}
cards.on_reset(_consts.clear)


def _batched(x: torch.Tensor, nd: int) -> tuple[torch.Tensor, bool]:
    """``x`` as [N, C, *S] and whether a batch dim was added."""
    if x.dim() == nd + 1:
        return x.unsqueeze(0), True
    if x.dim() != nd + 2:
        raise NotImplementedError
    return x, False


def _served(x: torch.Tensor, nd: int) -> bool:
    return x.dtype in _FLOATS and x.dim() in (nd + 1, nd + 2) and x.numel() > 0


def _or_empty(op):
    """``fn`` serving an empty input too: its outputs' shapes are the op's meta
    kernel's (which raises PyTorch's errors for arguments it rejects)."""

    def wrap(fn):
        def with_empty(x, *args, **kwargs):
            if isinstance(x, torch.Tensor) and x.numel() == 0 and x.dtype in _FLOATS:
                meta = op(*[torch.empty(a.shape, dtype=a.dtype, device="meta")
                            if isinstance(a, torch.Tensor) else a for a in (x, *args)], **kwargs)  # fmt: skip
                outs = meta if isinstance(meta, tuple) else (meta,)
                made = tuple(torch.empty(t.shape, dtype=t.dtype, device=x.device) for t in outs)
                return made if isinstance(meta, tuple) else made[0]
            return fn(x, *args, **kwargs)

        return with_empty

    return wrap


def _ints(v, nd: int, default=None) -> list[int]:
    if isinstance(v, int):
        v = [v]
    v = list(v) if v is not None else []
    if not v:
        return list(default) if default is not None else [0] * nd
    return [int(v[0])] * nd if len(v) == 1 else [int(a) for a in v]


def _pool_out(size, k, s, p, d, ceil_mode) -> int:
    """PyTorch's ``pooling_output_shape``."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    o = num // s + 1
    if ceil_mode and (o - 1) * s >= size + p:
        o -= 1
    return o


def _geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    k = _ints(kernel_size, nd)
    s = _ints(stride, nd, default=k)
    p = _ints(padding, nd)
    d = _ints(dilation, nd, default=[1] * nd)
    sizes = list(x.shape[2:])
    o = [_pool_out(n, *a, ceil_mode) for n, *a in zip(sizes, k, s, p, d)]
    # the right padding the last window needs (ceil mode reaches past it)
    pads = [(pi, (oi - 1) * si + (ki - 1) * di + 1 - n - pi)
            for n, ki, si, pi, di, oi in zip(sizes, k, s, p, d, o)]  # fmt: skip
    return k, s, d, pads, o


def _const(key, make) -> torch.Tensor:
    """A constant of a pooling's geometry, made on the host once and kept on the card."""
    t = _consts.get(key)
    if t is None:
        if len(_consts) > 256:
            _consts.clear()
        t = _consts[key] = make()
    return t


def _index_map(sizes, device) -> torch.Tensor:
    """``arange(prod(sizes))`` as [1, 1, *sizes] on the card (a fill program)."""
    return torch.arange(math.prod(sizes), device=device).view(1, 1, *sizes)


# -------------------------------------------------------------------- max pool
def max_windows(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    """Max pooling of [N, C, *S] ``x``: the values and each one's offset in its
    window (raster order over the kernel: what Inductor's low-memory max pool
    keeps), or None when the geometry is not served."""
    k, s, d, pads, o = _geometry(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    if min(o) <= 0:
        return None  # PyTorch's error, from the host
    win = windows.taps_first(windows.of(x, k, s, d, pads, -math.inf), nd)
    values, arg = win.max(0)
    return values, arg, (k, s, d, pads)


def max_values(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    """Max pooling's values alone (``F.max_pool2d`` without indices): the
    gather and one ``amax`` program, no argmax and no index gather; None when
    not served."""
    if not _served(x, nd):
        return None
    xb, added = _batched(x, nd)
    k, s, d, pads, o = _geometry(xb, nd, kernel_size, stride, padding, dilation, ceil_mode)
    if min(o) <= 0:
        return None
    values = windows.taps_first(windows.of(xb, k, s, d, pads, -math.inf), nd).amax(0)
    return values.squeeze(0) if added else values


def max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    if not _served(x, nd):
        return NotImplemented
    x, added = _batched(x, nd)
    got = max_windows(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    if got is None:
        return NotImplemented
    values, arg, (k, s, d, pads) = got
    where = windows.taps_first(windows.of(_index_map(x.shape[2:], x.device), k, s, d, pads, -1),
                               nd)  # fmt: skip
    where = where.expand(where.shape[0], *x.shape[:2], *where.shape[3:])
    indices = torch.gather(where, 0, arg.unsqueeze(0)).squeeze(0)
    if added:
        values, indices = values.squeeze(0), indices.squeeze(0)
    return values, indices


def _pair_out(fn):
    """The ``out=`` form of a kernel returning (values, indices)."""

    def with_out(*args, **kwargs):
        outs = [kwargs.pop(n) for n in ("out", "indices", "output") if n in kwargs]
        result = fn(*args, **kwargs)
        if result is NotImplemented:
            return result
        for dest, res in zip(outs, result):
            if dest.shape != res.shape:
                dest.resize_(res.shape)
            dest.copy_(res)
        return tuple(outs)

    return with_out


@kernel("max_pool2d_with_indices.default")
@_or_empty(torch.ops.aten.max_pool2d_with_indices.default)
def _max_pool2d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@kernel("max_pool3d_with_indices.default")
@_or_empty(torch.ops.aten.max_pool3d_with_indices.default)
def _max_pool3d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode)


kernel("max_pool2d_with_indices.out")(_pair_out(_max_pool2d))
kernel("max_pool3d_with_indices.out")(_pair_out(_max_pool3d))


# -------------------------------------------------------------------- avg pool
def _divisor(sizes, k, s, pads, o, count_include_pad, device, dtype) -> torch.Tensor:
    """Each window's divisor [*O], as PyTorch's avg_pool kernels count it."""

    def make():
        per_dim = []
        for n, ki, si, (lo, _), oi in zip(sizes, k, s, pads, o):
            start = torch.arange(oi) * si - lo
            end = torch.clamp(start + ki, max=n + lo)
            size = end - start
            start, end = start.clamp(min=0), end.clamp(max=n)
            per_dim.append(size if count_include_pad else end - start)
        div = per_dim[0]
        for v in per_dim[1:]:
            div = div[..., None] * v
        return div.to(dtype).to(device)

    return _const(("avg_div", tuple(sizes), tuple(k), tuple(s), tuple(pads), count_include_pad,
                   device, dtype), make)  # fmt: skip


def avg_pool(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    if not _served(x, nd):
        return NotImplemented
    x, added = _batched(x, nd)
    k, s, d, pads, o = _geometry(x, nd, kernel_size, stride, padding, None, ceil_mode)
    if min(o) <= 0:
        return NotImplemented
    sums = windows.taps_first(windows.of(x, k, s, d, pads, 0.0), nd).sum(0)
    if divisor_override:
        out = sums / float(divisor_override)
    else:
        out = sums / _divisor(x.shape[2:], k, s, pads, o, count_include_pad, x.device, x.dtype)
    return out.squeeze(0) if added else out


@kernel("avg_pool2d.default")
@_or_empty(torch.ops.aten.avg_pool2d.default)
def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):  # fmt: skip
    return avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad,
                    divisor_override)  # fmt: skip


@kernel("avg_pool3d.default")
@_or_empty(torch.ops.aten.avg_pool3d.default)
def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):  # fmt: skip
    return avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad,
                    divisor_override)  # fmt: skip


kernel("avg_pool2d.out")(out_variant(_avg_pool2d))
kernel("avg_pool3d.out")(out_variant(_avg_pool3d))


# --------------------------------------------------------------- adaptive pools
def _bounds(n: int, o: int) -> tuple[list[int], list[int]]:
    """PyTorch's adaptive windows: [floor(i*n/o), ceil((i+1)*n/o))."""
    starts = [(i * n) // o for i in range(o)]
    ends = [-((-(i + 1) * n) // o) for i in range(o)]
    return starts, ends


def _window_index(n: int, o: int, device) -> tuple[torch.Tensor, int]:
    """Sample indices [o * kmax] of the adaptive windows, short ones repeating their last."""
    starts, ends = _bounds(n, o)
    kmax = max(e - b for b, e in zip(starts, ends))

    def make():
        idx = [min(b + j, e - 1) for b, e in zip(starts, ends) for j in range(kmax)]
        return torch.tensor(idx, dtype=torch.int64).to(device)

    return _const(("adaptive_idx", n, o, device), make), kmax


def adaptive_max(x, nd, output_size):
    if not _served(x, nd):
        return NotImplemented
    x, added = _batched(x, nd)
    o = _ints(output_size, nd)
    if min(o) <= 0:
        return NotImplemented
    values = x
    where = _index_map(x.shape[2:], x.device).expand(x.shape)
    for i in reversed(range(nd)):
        dim = 2 + i
        idx, kmax = _window_index(x.shape[dim], o[i], x.device)
        shape = (*values.shape[:dim], o[i], kmax, *values.shape[dim + 1 :])
        values, arg = values.index_select(dim, idx).view(shape).max(dim + 1, keepdim=True)
        where = torch.gather(where.index_select(dim, idx).view(shape), dim + 1, arg)
        values, where = values.squeeze(dim + 1), where.squeeze(dim + 1)
    if added:
        values, where = values.squeeze(0), where.squeeze(0)
    return values, where


@kernel("adaptive_max_pool2d.default")
@_or_empty(torch.ops.aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(x, output_size):
    return adaptive_max(x, 2, output_size)


@kernel("adaptive_max_pool3d.default")
@_or_empty(torch.ops.aten.adaptive_max_pool3d.default)
def _adaptive_max_pool3d(x, output_size):
    return adaptive_max(x, 3, output_size)


kernel("adaptive_max_pool2d.out")(_pair_out(_adaptive_max_pool2d))
kernel("adaptive_max_pool3d.out")(_pair_out(_adaptive_max_pool3d))


def _averaging(n: int, o: int, device, dtype) -> torch.Tensor:
    """The [n, o] matrix whose column i averages adaptive window i."""

    def make():
        starts, ends = _bounds(n, o)
        m = torch.zeros(n, o, dtype=torch.float64)
        for i, (b, e) in enumerate(zip(starts, ends)):
            m[b:e, i] = 1.0 / (e - b)
        return m.to(dtype).to(device)

    return _const(("adaptive_avg", n, o, device, dtype), make)


def adaptive_avg(x, nd, output_size):
    if not _served(x, nd):
        return NotImplemented
    x, added = _batched(x, nd)
    o = _ints(output_size, nd)
    sizes = list(x.shape[2:])
    if min(o) <= 0:
        return NotImplemented
    if all(oi == 1 for oi in o):
        out = x.mean(dim=list(range(2, 2 + nd)), keepdim=True)
    elif all(n % oi == 0 for n, oi in zip(sizes, o)):
        k = [n // oi for n, oi in zip(sizes, o)]
        out = avg_pool(x, nd, k, k, [0] * nd, False, True, None)
    else:
        out = x
        for i in range(nd):
            moved = out.movedim(2 + i, -1)
            out = torch.matmul(moved, _averaging(sizes[i], o[i], x.device, x.dtype))
            out = out.movedim(-1, 2 + i)
        out = out.contiguous()
    return out.squeeze(0) if added else out


@kernel("_adaptive_avg_pool2d.default")
@_or_empty(torch.ops.aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(x, output_size):
    return adaptive_avg(x, 2, output_size)


@kernel("_adaptive_avg_pool3d.default")
@_or_empty(torch.ops.aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(x, output_size):
    return adaptive_avg(x, 3, output_size)


# ------------------------------------------------------------- fractional max
def fractional_max(x, nd, kernel_size, output_size, samples):
    """PyTorch's fractional max pooling: per plane and dim, window starts
    ``int((i + u) * alpha) - int(u * alpha)`` (the last at S - K), with
    ``alpha = (S - K) / (O - 1)`` and ``u`` the plane's random sample, computed
    on the card in the input's dtype as the CPU kernel does."""
    if not _served(x, nd) or not samples.dtype.is_floating_point:
        return NotImplemented
    x, added = _batched(x, nd)
    k, o = _ints(kernel_size, nd), _ints(output_size, nd)
    n, c = x.shape[:2]
    if samples.dim() != 3 or samples.shape[0] < n or samples.shape[1:] != (c, nd):
        return NotImplemented
    if any(oi + ki - 1 > s for oi, ki, s in zip(o, k, x.shape[2:])):
        return NotImplemented
    # the samples are an input (a module may hold them on the host, in float64):
    # the card reads them in the input's dtype
    samples = samples[:n].to(device=x.device, dtype=x.dtype)
    values = x
    where = _index_map(x.shape[2:], x.device).expand(x.shape)
    for i in reversed(range(nd)):
        dim, size = 2 + i, x.shape[2 + i]
        # PyTorch's samples run [w, h] / [t, h, w]: dim i of a 2d pool takes sample 1 - i
        u = samples[:, :, (nd - 1 - i) if nd == 2 else i].unsqueeze(-1)  # [n, c, 1]
        if o[i] == 1:
            starts = torch.full((n, c, 1), size - k[i], dtype=torch.int64, device=x.device)
        else:
            # a constant of the shapes, rounded to the input's dtype as the CPU's is
            alpha = (torch.tensor(float(size - k[i]), dtype=x.dtype) / (o[i] - 1)).item()
            steps = torch.arange(o[i], device=x.device).to(x.dtype)
            starts = ((steps + u) * alpha).trunc().long() - (u * alpha).trunc().long()
            last = torch.full_like(starts[..., -1:], size - k[i])
            starts = torch.cat([starts[..., :-1], last], -1)
        taps = torch.arange(k[i], device=x.device)
        idx = (starts.unsqueeze(-1) + taps).reshape(n, c, o[i] * k[i])  # [n, c, o*k]
        shape = [n, c, *values.shape[2:]]
        shape[dim] = o[i] * k[i]
        view = [1] * len(shape)
        view[0], view[1], view[dim] = n, c, o[i] * k[i]
        idx = idx.view(view).expand(shape)
        split = (*shape[:dim], o[i], k[i], *shape[dim + 1 :])
        values, arg = torch.gather(values, dim, idx).view(split).max(dim + 1, keepdim=True)
        where = torch.gather(torch.gather(where, dim, idx).view(split), dim + 1, arg)
        values, where = values.squeeze(dim + 1), where.squeeze(dim + 1)
    if added:
        values, where = values.squeeze(0), where.squeeze(0)
    return values, where


@kernel("fractional_max_pool2d.default")
@_or_empty(torch.ops.aten.fractional_max_pool2d.default)
def _fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return fractional_max(x, 2, kernel_size, output_size, random_samples)


@kernel("fractional_max_pool3d.default")
@_or_empty(torch.ops.aten.fractional_max_pool3d.default)
def _fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return fractional_max(x, 3, kernel_size, output_size, random_samples)


kernel("fractional_max_pool2d.output")(_pair_out(_fractional_max_pool2d))
kernel("fractional_max_pool3d.output")(_pair_out(_fractional_max_pool3d))
