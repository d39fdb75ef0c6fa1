"""IBM's layout constructor forms and helpers over our one ``SpyreTensorLayout``."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from torch_spyre.compat.dtypes import DataFormats, _host_dtype, get_device_dtype
from torch_spyre.layout import (
    SpyreTensorLayout,
    stick_elems,
)


def layout_fields(*args, **kwargs) -> tuple[tuple, tuple, tuple, torch.dtype]:
    """Our (host_size, device_size, dim_map, dtype) for IBM's constructor forms.

    * ``(size, dtype)``: the default layout of ``size``;
    * ``(size, stride, dtype, dim_order)``: ``dim_order[-1]`` is the stick
      dimension; device = [dim_order[1:] (the stick dim as stick count),
      dim_order[0], stick] (IBM's "generic stick" rule);
    * ``(device_size, stride_map, device_dtype)`` (keywords, or positional with
      a ``DataFormats``): host element stride of each device dim, -1 for none.
      Such a layout has no host shape; it is given the one it describes
      exactly and is fitted to a tensor's shape when it is used.
    """
    names = ("size", "stride", "dtype", "dim_order")
    if "device_size" in kwargs or "stride_map" in kwargs or "device_dtype" in kwargs:
        return _fields_from_device(*args, **kwargs)
    if len(args) == 3 and not kwargs and isinstance(args[2], DataFormats):
        return _fields_from_device(*args)
    bound = dict(zip(names if len(args) != 2 else ("size", "dtype"), args))
    overlap = set(bound) & set(kwargs)
    if overlap or set(kwargs) - set(names):
        raise TypeError(_usage(args, kwargs))
    bound.update(kwargs)
    if "size" not in bound or "dtype" not in bound:
        raise TypeError(_usage(args, kwargs))
    size = [int(s) for s in bound["size"]]
    dtype = _host_dtype(bound["dtype"])
    if "stride" not in bound and "dim_order" not in bound:
        lay = SpyreTensorLayout.default(tuple(size), dtype)
    else:
        stride = bound.get("stride")
        dim_order = bound.get("dim_order", list(range(len(size))))
        lay = _from_dim_order(size, stride, dtype, [int(d) for d in dim_order])
    return lay.host_size, lay.device_size, lay.dim_map, lay.dtype


def _usage(args, kwargs) -> str:
    return (
        f"SpyreTensorLayout() got {len(args)} positional argument(s) and keywords "
        f"{sorted(kwargs)}; use one of SpyreTensorLayout(size, dtype), "
        f"SpyreTensorLayout(size, stride, dtype, dim_order), "
        f"SpyreTensorLayout(device_size=..., stride_map=..., device_dtype=...) or "
        f"SpyreTensorLayout(host_size, device_size, dim_map, dtype)"
    )


def _contiguous_strides(size: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


def _from_dim_order(size, stride, dtype, dim_order) -> SpyreTensorLayout:
    n = len(size)
    if stride is not None and [int(s) for s in stride] != _contiguous_strides(size):
        raise NotImplementedError(
            f"SpyreTensorLayout(size={size}, stride={list(stride)}, ...): only contiguous "
            f"host strides ({_contiguous_strides(size)}) are supported; lay out the "
            f"contiguous tensor (tensor.contiguous()) instead"
        )
    if dim_order and dim_order[-1] == -1:
        # a sparse stick layout: one element per stick, the rest padding.  The
        # stick pads a trailing host dim of size 1 (the tensor is a view of
        # size + [1]): device memory holds stick_elems times the values.
        if -1 in dim_order[:-1]:
            raise ValueError(f"dim_order={dim_order}: only the last entry may be -1")
        return _from_dim_order(list(size) + [1], None, dtype, list(dim_order[:-1]) + [n])
    if sorted(dim_order) != list(range(n)):
        raise ValueError(
            f"dim_order={dim_order} must be a permutation of the {n} host dims of size {size}"
        )
    if n == 0:
        return SpyreTensorLayout.default((), dtype)
    se = stick_elems(dtype)
    stick = dim_order[-1]

    def extent(k: int) -> int:
        return -(-size[k] // se) if k == stick else size[k]

    order = dim_order[1:] + [dim_order[0]]
    return SpyreTensorLayout(
        tuple(size), tuple(extent(k) for k in order) + (se,), tuple(order) + (stick,), dtype
    )


def _fields_from_device(
    device_size=None, stride_map=None, device_dtype=None, **extra
) -> tuple[tuple, tuple, tuple, torch.dtype]:
    if extra or device_size is None or stride_map is None or device_dtype is None:
        raise TypeError(
            "SpyreTensorLayout(device_size=..., stride_map=..., device_dtype=...) needs "
            f"exactly those three, got device_size={device_size!r}, stride_map={stride_map!r}, "
            f"device_dtype={device_dtype!r} and {sorted(extra)}"
        )
    lay = from_device(device_size, stride_map, _host_dtype(device_dtype))
    return lay.host_size, lay.device_size, lay.dim_map, lay.dtype


def from_device(
    device_size: Sequence[int],
    stride_map: Sequence[int],
    dtype: torch.dtype,
    host_size: Sequence[int] | None = None,
) -> SpyreTensorLayout:
    """Our layout of IBM's (device_size, stride_map), for ``host_size`` if given,
    else for the host shape it describes exactly.  A ValueError says what does
    not fit."""
    dev = [int(s) for s in device_size]
    strides = [int(s) for s in stride_map]
    what = f"device_size={dev}, stride_map={strides} ({dtype})"
    if _stick_pads_a_one(dev, strides):
        strides[-1] = -1
    if len(dev) != len(strides) or len(dev) < 2:
        raise ValueError(f"{what}: need one stride per device dim, and at least 2 dims")
    if dev[-1] != stick_elems(dtype):
        raise ValueError(
            f"{what}: the last device dim must be one stick of {stick_elems(dtype)} elements"
        )
    if host_size is None:
        host, dim_map = _infer_host(dev, strides, what)
    else:
        host = [int(s) for s in host_size]
        dim_map = _dim_map_for(dev, strides, host, what)
    try:
        lay = SpyreTensorLayout(tuple(host), tuple(dev), tuple(dim_map), dtype)
    except ValueError as err:
        raise ValueError(f"{what} does not lay out host size {host}: {err}") from None
    if _norm(lay.device_size, lay.stride_map) != _norm(dev, strides):
        raise ValueError(
            f"{what} does not lay out host size {host} (as laid out here its strides "
            f"would be {list(lay.stride_map)})"
        )
    return lay


def _stick_pads_a_one(dev, strides) -> bool:
    """True when the stick repeats another device dim's stride: it then pads a
    trailing host dim of size 1 (one element per stick; a tensor is a view of
    its size + [1]), whose stride IBM writes as any value."""
    return strides[-1] != -1 and any(
        s == strides[-1] for n, s in zip(dev[:-1], strides[:-1]) if n > 1
    )


def _norm(dev, strides) -> list[int]:
    """Strides that matter: a device dim of size 1 has none (IBM writes -1 for
    it, hf-adapters sometimes the stride it would have)."""
    return [s if n > 1 else -1 for n, s in zip(dev, strides)]


def _dim_map_for(dev, strides, host, what) -> list[int]:
    hs = _contiguous_strides(host)
    ones = [k for k, s in enumerate(host) if s == 1]
    dim_map = []
    for d, (size, s) in enumerate(zip(dev, strides)):
        if s == 0 and d != len(dev) - 1:
            dim_map.append(-1)  # a broadcast dim: the data repeated
            continue
        if s == -1 or size == 1:
            if size == 1:
                dim_map.append(-1)
            elif d == len(dev) - 1 and ones:
                dim_map.append(ones[-1])  # the stick of a size-1 dim: padding only
            else:
                raise ValueError(f"{what}: device dim {d} of size {size} has stride -1")
            continue
        ks = [k for k in range(len(host)) if host[k] > 1 and hs[k] <= s < hs[k] * host[k]]
        if len(ks) != 1 or s % hs[ks[0]]:
            raise ValueError(f"{what}: stride {s} of device dim {d} is no stride of host {host}")
        dim_map.append(ks[0])
    return dim_map


def _infer_host(dev, strides, what) -> tuple[list[int], list[int]]:
    """The host shape that (dev, strides) lays out exactly: one host dim per
    device dim, except the stick dim, which shares its host dim with the dim
    that counts its sticks (stride = stick stride x stick size)."""
    n = len(dev)
    last = n - 1
    strides = _norm(dev, strides)
    groups: list[list[int]] = []
    if strides[last] != -1:
        outer = [e for e in range(last) if strides[e] == strides[last] * dev[last] and dev[e] > 1]
        groups.append([outer[-1], last] if outer else [last])
    for d in range(n):
        if strides[d] == 0:
            continue  # a broadcast dim: the data repeated, no host dim
        if strides[d] != -1 and not any(d in g for g in groups):
            groups.append([d])
        elif strides[d] == -1 and dev[d] != 1 and d != last:
            raise ValueError(f"{what}: device dim {d} of size {dev[d]} has stride -1")
    groups.sort(key=lambda g: -min(strides[d] for d in g))
    base = [min(strides[d] for d in g) for g in groups]
    host = []
    for i, g in enumerate(groups):
        span = math.prod(dev[d] for d in g)
        if i == 0:
            host.append(span)
            continue
        if base[i - 1] % base[i] or base[i - 1] // base[i] > span:
            raise ValueError(f"{what}: strides {base[i - 1]} and {base[i]} leave host gaps")
        host.append(base[i - 1] // base[i])
    if groups and base[-1] != 1:
        raise ValueError(f"{what}: no device dim has host stride 1")
    dim_map = [-1] * n
    for k, g in enumerate(groups):
        for d in g:
            dim_map[d] = k
    if strides[last] == -1:  # the stick pads a host dim of size 1
        host.append(1)
        dim_map[last] = len(host) - 1
    return host, dim_map


def same_device_layout(a: SpyreTensorLayout, b: SpyreTensorLayout) -> bool:
    """IBM's equality: the same device_size, stride_map and device dtype."""
    return (a.device_size, _norm(a.device_size, a.stride_map), a.device_dtype) == (
        b.device_size,
        _norm(b.device_size, b.stride_map),
        b.device_dtype,
    )


def fit(
    layout: SpyreTensorLayout,
    size: Sequence[int],
    dtype: torch.dtype,
    strides: Sequence[int] | None = None,
) -> SpyreTensorLayout:
    """``layout`` for a tensor of ``size`` and ``dtype`` (the layout's
    ``stride_map`` read against ``strides``, the source tensor's element
    strides, when given: IBM's stride maps are strides of the host tensor as
    it is in memory, e.g. a transposed one).

    In order: the layout of ``size`` itself (padding in any dim, stick dims
    of size-1 dims); the layout's own host shape, when it has as many
    elements (e.g. IBM's slot-major KV pages, whose first device dim spans
    two host dims: the tensor is a view of it); the *folded* layout, where
    the tensor's elements in order are packed into sticks across rows (e.g.
    a [40, 60] fp16 tensor as device_size [38, 64], stride_map [64, 1]: 38
    sticks where rows padded to whole sticks take 40).
    """
    size = [int(s) for s in size]
    numel = math.prod(size)
    if get_device_dtype(dtype) != layout.device_dtype:
        raise ValueError(
            f"device_layout {layout} stores {layout.device_dtype}, but the tensor is {dtype} "
            f"({get_device_dtype(dtype)}): build the layout for {dtype}"
        )
    dev, smap = list(layout.device_size), list(layout.stride_map)
    if strides is not None and [int(s) for s in strides] != _contiguous_strides(size):
        smap = _logical_strides(dev, smap, size, [int(s) for s in strides])
    if smap is not None:
        with contextlib.suppress(ValueError):
            return from_device(dev, smap, dtype, size)
        if _stick_pads_a_one(dev, smap):
            with contextlib.suppress(ValueError):
                return from_device(dev, smap, dtype, size + [1])
    if layout.numel == numel and smap == list(layout.stride_map):
        return layout
    if smap is not None and len(size) != 1:
        with contextlib.suppress(ValueError):
            return from_device(dev, smap, dtype, [numel])  # folded
    if layout.numel > numel and smap == list(layout.stride_map):
        # a tiled host shape with padding blocks (e.g. [40, 60] as 2 blocks of
        # 24 rows): the tensor is the first ``numel`` elements of it, in order
        return layout
    raise ValueError(
        f"device_layout {layout} lays out {layout.numel} elements (host size "
        f"{list(layout.host_size)}), but the tensor of size {size} has {numel}, and its "
        f"elements in order (folded) do not fit it either"
    )


def _logical_strides(dev, smap, size, strides) -> list[int] | None:
    """``smap`` (strides of a tensor of ``size`` with element ``strides``) as
    strides of the contiguous tensor of ``size``; None when a device dim
    steps through no single host dim."""
    contiguous = _contiguous_strides(size)
    out = []
    for n, s in zip(dev, smap):
        if n == 1 or s == -1:
            out.append(-1)
            continue
        ks = [
            k
            for k in range(len(size))
            if size[k] > 1 and strides[k] > 0 and s % strides[k] == 0 and s >= strides[k]
        ]
        ks = [k for k in ks if s // strides[k] < size[k]] or ks[-1:]
        if len(ks) != 1:
            return None
        out.append(contiguous[ks[0]] * (s // strides[ks[0]]))
    return out


def empty_in_layout(
    size: Sequence[int],
    layout: SpyreTensorLayout,
    dtype: torch.dtype | None,
    device: Any,
    strides: Sequence[int] | None = None,
) -> torch.Tensor:
    """A new contiguous spyre tensor of ``size`` whose storage is in ``layout``
    (``strides``: of the tensor whose memory ``layout``'s stride_map describes,
    when not contiguous; see ``fit``)."""
    from torch_spyre import _C

    if not isinstance(layout, SpyreTensorLayout):
        raise TypeError(
            f"device_layout must be a torch.spyre.SpyreTensorLayout, got {type(layout).__name__}"
        )
    dtype = dtype or layout.dtype
    device = _spyre_target(device)
    lay = fit(layout, size, dtype, strides)
    index = device.index if device.index is not None else _C._get_device()
    return _C._empty_in_layout(
        [int(s) for s in size],
        list(lay.host_size),
        list(lay.device_size),
        list(lay.dim_map),
        torch.empty(0, dtype=dtype),
        index,
    )


def _spyre_target(device: Any) -> torch.device:
    """Where a tensor with a device_layout goes: spyre, always, as on IBM's stack
    (a layout only exists in device memory); another device is warned about."""
    device = torch.device("spyre") if device is None else torch.device(device)
    if device.type == "spyre":
        return device
    warnings.warn(
        f"device_layout= places the tensor on spyre (the current card), not on {device}, "
        f"as IBM's torch-spyre does; drop device_layout= for a {device.type} tensor",
        UserWarning,
        stacklevel=4,
    )
    return torch.device("spyre")
