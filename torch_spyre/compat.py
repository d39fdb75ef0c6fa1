"""IBM's public torch-spyre names, mapped onto our one implementation.

IBM's clients (spyre-inference, hf-adapters) are written against IBM's
torch-spyre: ``torch_spyre._C.SpyreTensorLayout`` with its three constructor
forms, ``DataFormats``, ``get_device_dtype``, ``device_layout=`` on
``Tensor.to`` and the factories, ``torch.spyre.memory``, the downcast-warning
switches, ``torch_spyre._inductor.{config, constants, decompositions}`` and
``torch_spyre.ops.fallbacks.FallbackWarning``.  This module is the only place
that knows those names; what is behind each is ours: one layout class
(``torch_spyre.layout.SpyreTensorLayout``), one allocator, one fallback, one
compiler.  Our own code never calls it.  What differs on purpose, and why:
docs/compat.md.

``install()`` (run by ``import torch_spyre``) puts the names in place.  Two
of them patch PyTorch, because no public extension point takes a new keyword
argument: ``Tensor.to`` and the factories accept ``device_layout=`` (PyTorch's
argument parser rejects unknown keywords before any dispatch or
``__torch_function__`` mode sees the call).  tests/runtime/test_compat.py
fails if either patch stops working.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
import os
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torch_spyre.layout import (
    STICK_BYTES,
    SpyreTensorLayout,
    UnsupportedDtypeError,
    check_dtype,
    stick_elems,
)


# ------------------------------------------------------------------ dtypes
class DataFormats(enum.Enum):
    """How device memory stores elements, in IBM's names (a plain Enum: its
    members print as ``DataFormats.SEN169_FP16``, as IBM's do)."""

    SEN169_FP16 = "float16"  # the card's 16-bit float (IBM's DL16 slot)
    BFLOAT16 = "bfloat16"
    IEEE_FP32 = "float32"
    SEN143_FP8 = "float8_e4m3fn"  # 1 sign, 4 exponent, 3 mantissa bits
    SEN152_FP8 = "float8_e5m2"  # 1 sign, 5 exponent, 2 mantissa bits
    SENINT8 = "int8"
    SENUINT8 = "uint8"
    SENINT16 = "int16"
    IEEE_INT32 = "int32"
    IEEE_INT64 = "int64"  # IBM narrows int64 to IEEE_INT32; we store it exactly
    BOOL = "bool"  # one byte; IBM stores bool as SEN169_FP16
    IEEE_COMPLEX64 = "complex64"  # ours: interleaved fp32 (re, im) pairs; IBM has none

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.value)


def get_device_dtype(dtype: torch.dtype) -> DataFormats:
    """The ``DataFormats`` in which device memory stores host ``dtype``."""
    if isinstance(dtype, DataFormats):
        return dtype
    check_dtype(dtype)  # the TypeError names the supported set
    return DataFormats(str(dtype).removeprefix("torch."))


def get_elem_in_stick(dtype: torch.dtype | DataFormats) -> int:
    """Elements of ``dtype`` in one 128-byte stick."""
    return stick_elems(_host_dtype(dtype))


def _host_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, DataFormats):
        return dtype.torch_dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(
        f"expected a torch.dtype or a torch.spyre.DataFormats member, got {dtype!r} "
        f"(e.g. torch.float16 or DataFormats.SEN169_FP16)"
    )


# ----------------------------------------------------------------- layouts
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


# ------------------------------------------------- device_layout= patches
_orig_to = torch.Tensor.to
_orig_factories: dict[str, Any] = {}


def _dtype_named(arg: Any) -> Any:
    """IBM's ``Tensor.to`` takes a dtype by name ("torch.float32", as their
    model-op YAML records it); anything else is passed on."""
    if isinstance(arg, str) and arg.startswith("torch."):
        dtype = getattr(torch, arg.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return arg


@contextlib.contextmanager
def _dtype_error_as_ibm() -> Iterator[None]:
    """The C++ dtype check raises a TypeError, IBM's runtime a RuntimeError:
    ours (``layout.UnsupportedDtypeError``) is both."""
    try:
        yield
    except TypeError as err:
        if type(err) is TypeError and str(err).startswith("spyre does not store"):
            raise UnsupportedDtypeError(str(err)) from None
        raise


def _to(self: torch.Tensor, *args, device_layout: SpyreTensorLayout | None = None, **kwargs):
    args = tuple(_dtype_named(a) for a in args)
    if "dtype" in kwargs:
        kwargs["dtype"] = _dtype_named(kwargs["dtype"])
    if device_layout is None:
        with _dtype_error_as_ibm():
            return _orig_to(self, *args, **kwargs)
    if not isinstance(device_layout, SpyreTensorLayout):
        raise TypeError(
            f"device_layout must be a torch.spyre.SpyreTensorLayout, got "
            f"{type(device_layout).__name__}"
        )
    copy = bool(kwargs.pop("copy", False))
    device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
    device = _spyre_target(device or self.device)
    dtype = dtype or self.dtype
    if (
        not copy
        and self.device.type == "spyre"
        and (device.index is None or device == self.device)
        and dtype == self.dtype
        and self.is_contiguous()
        and same_device_layout(self.device_tensor_layout(), fit(device_layout, self.shape, dtype))
    ):
        return self
    strides = None if self.is_contiguous() else self.stride()
    out = empty_in_layout(self.shape, device_layout, dtype, device, strides)
    out.copy_(self)
    return out


def _sizes(args, size) -> list[int]:
    if size is not None:
        if args:
            raise TypeError("empty() got both a positional size and size=")
        args = (size,)
    if len(args) == 1 and isinstance(args[0], Sequence | torch.Size):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


def _factory(name: str, fill_arg: bool):
    orig = getattr(torch, name)
    _orig_factories[name] = orig

    @functools.wraps(orig)
    def factory(*args, device_layout: SpyreTensorLayout | None = None, **kwargs):
        if args and "size" in kwargs:  # IBM's (PyTorch's parser's) wording
            raise TypeError(
                f"{name}() received an invalid combination of arguments: a positional "
                f"size and size= (give one)"
            )
        if device_layout is None:
            with _dtype_error_as_ibm():
                return orig(*args, **kwargs)
        args = list(args)
        fill = (
            (kwargs.pop("fill_value") if "fill_value" in kwargs else args.pop()) if fill_arg else 0
        )
        requires_grad = kwargs.pop("requires_grad", False)
        dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
        fmt = kwargs.get("memory_format")
        if fmt is not None and fmt not in (torch.contiguous_format, torch.preserve_format):
            # a device layout fixes where every element goes: the host strides
            # are the contiguous ones (without device_layout= we take any format)
            raise RuntimeError(
                f"Spyre backend only supports contiguous memory format with device_layout= "
                f"(got {fmt}); drop device_layout= for a {fmt} tensor in the default layout"
            )
        for ignored in ("layout", "pin_memory", "memory_format", "out"):
            value = kwargs.pop(ignored, None)
            if ignored == "out" and value is not None:
                raise TypeError(f"torch.{name}(..., device_layout=...) does not take out=")
        size = _sizes(args, kwargs.pop("size", None))
        if kwargs:
            raise TypeError(f"torch.{name}() got unexpected keywords {sorted(kwargs)}")
        out = empty_in_layout(size, device_layout, dtype, device)
        if name != "empty":
            out.fill_(fill)
        return out.requires_grad_(requires_grad) if requires_grad else out

    return factory


_FACTORIES = {"empty": False, "zeros": False, "full": True}


def _ones(*args, device_layout=None, **kwargs):
    if device_layout is None:
        return _orig_factories["ones"](*args, **kwargs)
    return _patched["zeros"](*args, device_layout=device_layout, **kwargs).fill_(1)


_patched: dict[str, Any] = {}


def _install_device_layout() -> None:
    if getattr(torch.Tensor.to, "__wrapped_by_spyre__", False):
        return
    # `with torch.device(...)` recognises factories by identity in a cached set:
    # fill the cache with the original functions before replacing them.
    from torch.utils._device import _device_constructors

    _device_constructors()
    _to.__wrapped_by_spyre__ = True  # type: ignore[attr-defined]
    functools.update_wrapper(_to, _orig_to, assigned=("__doc__", "__name__", "__qualname__"))
    _to.__signature__ = _signature(method=True)  # type: ignore[attr-defined]
    torch.Tensor.to = _to  # type: ignore[method-assign]
    for name, fill in _FACTORIES.items():
        _patched[name] = _factory(name, fill)
        _patched[name].__signature__ = _signature(method=False)
        setattr(torch, name, _patched[name])
    _orig_factories["ones"] = torch.ones
    functools.update_wrapper(_ones, torch.ones)
    _ones.__signature__ = _signature(method=False)  # type: ignore[attr-defined]
    torch.ones = _ones  # type: ignore[assignment]


def _signature(method: bool) -> inspect.Signature:
    """What inspect reports for the patched functions (the wrapped builtins
    have none): the device_layout= keyword, the rest as PyTorch parses it."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_ONLY)] if method else []
    params += [
        P("args", P.VAR_POSITIONAL),
        P("device_layout", P.KEYWORD_ONLY, default=None),
        P("kwargs", P.VAR_KEYWORD),
    ]
    return inspect.Signature(params)


# ------------------------------------------------------------- torch.spyre
_downcast_warning = True


def get_downcast_warning() -> bool:
    """IBM warns when int64 is narrowed to int32; this card stores int64
    exactly, so there is nothing to warn about.  The switch is kept."""
    return _downcast_warning


def set_downcast_warning(enabled: bool) -> None:
    global _downcast_warning
    _downcast_warning = bool(enabled)


def _memory_module() -> types.ModuleType:
    from torch_spyre.runtime import device_module as dm

    mod = types.ModuleType("torch.spyre.memory", "torch.spyre's memory API, IBM's module path.")

    def reset_accumulated_memory_stats(device=None) -> None:
        torch.accelerator.reset_accumulated_memory_stats(torch.device("spyre", dm._checked(device)))

    for fn in (
        dm.memory_allocated,
        dm.max_memory_allocated,
        dm.reset_peak_memory_stats,
        dm.memory_reserved,
        dm.max_memory_reserved,
        dm.memory_stats,
        dm.memory_summary,
        dm.mem_get_info,
        dm.empty_cache,
        reset_accumulated_memory_stats,
    ):
        setattr(mod, fn.__name__, fn)
    return mod


# -------------------------------------------------------------- warnings
def fallback_warning() -> type[Warning]:
    from torch_spyre.runtime.fallback import SpyreFallbackWarning

    return SpyreFallbackWarning


# ------------------------------------------------- torch_spyre._inductor
class InductorConfig(types.ModuleType):
    """``torch_spyre._inductor.config``: IBM's option names over our compiler
    options.  ``sencores`` is the planning core count
    (``torch_spyre.kernels.options``); every other IBM option is accepted and
    kept, and has no effect here (docs/compat.md says why, per option)."""

    #: IBM's options and their defaults; only `sencores` changes our planning
    DEFAULTS: dict[str, Any] = {
        "lx_planning": True,
        "co_optimizing_lx_planning": False,
        "hbm_pool_planning": True,
        "enable_lx_context_switching": True,
        "frontend_pool_allocation": False,
        "conv2d_direct_lowering": False,
        "ktir_emitter": False,
        "async_dxp_compile": False,
        "allow_all_ops_in_lx_planning": False,
        "dxp_lx_frac_avail": 0.2,
        "sencores": 32,
        "max_buckets": 32,
        "min_default_granularity": 4,
        "ignore_work_division_hints": False,
        "read_copy_elision": True,
        "log_passes": "",
        "cost_model": "",
        "layout_solver": "cpsat",
        "validate_op_specs": True,
        "spyre_kernel_cache": False,
    }

    def __getattr__(self, name: str) -> Any:
        if name == "sencores":
            from torch_spyre.kernels import options

            return options.current().cores or self.DEFAULTS["sencores"]
        values = self.__dict__.setdefault("_values", dict(self.DEFAULTS))
        if name in values:
            return values[name]
        raise AttributeError(f"torch_spyre._inductor.config has no option {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):
            super().__setattr__(name, value)
        elif name == "sencores":
            from torch_spyre.kernels import options

            options.configure(cores=None if value is None else int(value))
        else:
            self.__dict__.setdefault("_values", dict(self.DEFAULTS))[name] = value

    @contextlib.contextmanager
    def patch(self, changes: dict[str, Any] | None = None, **kw: Any) -> Iterator[None]:
        from torch_spyre.kernels import options

        changes = {**(changes or {}), **kw}
        old = {k: options.current().cores if k == "sencores" else getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self, k, v)


#: the decompositions our backend adds to Inductor's own table: none (our
#: lowering takes Inductor's decomposed graph as it is)
spyre_decompositions: dict = {}

CONSTANTS: dict[str, Any] = {
    "DEVICE_NAME": "spyre",
    "BYTES_IN_STICK": STICK_BYTES,
    "FP8_E4M3FN_INFO": torch.finfo(torch.float8_e4m3fn),
    "FP8_E4M3FN_MAX": float(torch.finfo(torch.float8_e4m3fn).max),
    "FP8_E4M3FN_MIN": float(torch.finfo(torch.float8_e4m3fn).min),
}


# ------------------------------------------------------- IBM's fp8 ops
#: IBM's torch.ops.spyre fp8 ops over ours (torch_spyre/ops/quantized.py), with
#: IBM's semantics (its spyre-inference tests/test_fp8.py reference):
#: quantize = (x / scale).clamp(-FP8_E4M3FN_MAX, FP8_E4M3FN_MAX).to(float8_e4m3fn),
#: dequantize = x_fp8.to(float16) * scale (float16 out); the scale broadcasts
#: against the input (IBM: [1] per tensor or [batch, seq, 1] per token).
#: ``quantize_weight_fp8_with_scale`` gives the same values (IBM's weight
#: layout, QFP8WT, is a layout of IBM's compiler; ours is the one stick layout).
#: ``qfp8ch`` / ``qfp8wt`` are the format conversion alone (input already
#: scaled and clamped).  Composite ops: one device kernel eagerly, and what
#: torch.compile traces into the compiler's programs.
_IBM_FP8_OPS = {
    "quantize_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.quantize(input, scale, torch.float8_e4m3fn)
    ),
    "quantize_weight_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.quantize(input, scale, torch.float8_e4m3fn)
    ),
    "dequantize_fp8_with_scale(Tensor input, Tensor scale) -> Tensor": (
        lambda input, scale: torch.ops.spyre.dequantize(input, scale, torch.float16)
    ),
    "qfp8ch(Tensor input) -> Tensor": lambda input: input.to(torch.float8_e4m3fn),
    "qfp8wt(Tensor input) -> Tensor": lambda input: input.to(torch.float8_e4m3fn),
}
_ibm_lib: list[torch.library.Library] = []


def _install_fp8_ops() -> None:
    if _ibm_lib:
        return
    import torch_spyre.ops.quantized  # noqa: F401  (defines spyre::quantize, dequantize)

    lib = torch.library.Library("spyre", "FRAGMENT")
    for schema, fn in _IBM_FP8_OPS.items():
        lib.define(schema)
        lib.impl(schema.split("(")[0], fn, "CompositeImplicitAutograd")
    _ibm_lib.append(lib)


# ------------------------------------------------- device state, streams
class _Members(enum.IntEnum):
    """An int enum that prints as pybind11's do (``SpyreDeviceState.Ok``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class SpyreDeviceState(_Members):
    """IBM's device state (``_C.SpyreDeviceState``), read from the card."""

    Ok = 0
    NotInitialized = 1
    StreamError = 2


class SpyreStreamError(_Members):
    """IBM's stream error codes (``_C.SpyreStreamError``)."""

    Success = 0
    Shutdown = 1


class ElementArrangement(_Members):
    """IBM's element arrangements; we store every dtype STANDARD (our own
    formats: DL16, fp8 with scales, are chosen by the dtype, not the layout)."""

    STANDARD = 0
    DL16_TO_FP32 = 1
    QFP8CH = 2
    EXX2 = 3
    FP32_TO_DL16 = 4
    QFP8WT = 5


def get_device_state() -> SpyreDeviceState:
    """``StreamError`` while any card's stream is in error (a kernel failed on
    the card; ``torch.spyre.reset_device_state()`` clears it), else ``Ok``.
    Our cards start with the process, so never ``NotInitialized``."""
    from torch_spyre.runtime import cards

    if any(cards.stream_error(i) for i in range(cards.num_cards())):
        return SpyreDeviceState.StreamError
    return SpyreDeviceState.Ok


def stream_get_error(stream: Any) -> SpyreStreamError:
    """``Shutdown`` when the stream's card is in a stream error."""
    from torch_spyre.runtime import cards

    dev = stream.device() if callable(getattr(stream, "device", None)) else stream.device
    index = dev.index if isinstance(dev, torch.device) and dev.index is not None else 0
    return SpyreStreamError.Shutdown if cards.stream_error(index) else SpyreStreamError.Success


def stream_get_error_string(error: SpyreStreamError) -> str:
    return SpyreStreamError(int(error)).name


class _SpyreStreamBase:
    """IBM's stream handle (``id()``, ``device()``, ... as methods) over a torch.Stream."""

    def __init__(self, stream: torch.Stream) -> None:
        self._stream = stream

    def synchronize(self) -> None:
        self._stream.synchronize()

    def query(self) -> bool:
        return self._stream.query()

    def device(self) -> torch.device:
        return self._stream.device

    def id(self) -> int:
        return self._stream.stream_id

    def priority(self) -> int:
        return self._stream.priority

    def __repr__(self) -> str:
        return f"<torch_spyre._C._SpyreStreamBase id={self.id()} device={self.device()}>"


#: IBM's host-compute streams (for host work beside the card's): a pool per
#: card, handed out round-robin
HOST_COMPUTE_STREAMS = 4
_host_streams: dict[int, list[torch.Stream]] = {}
_host_next: dict[int, int] = {}


def _device_index(device: Any) -> int:
    from torch_spyre import _C

    device = torch.device(device) if device is not None else torch.device("spyre")
    return device.index if device.index is not None else _C._get_device()


def _host_pool(index: int) -> list[torch.Stream]:
    pool = _host_streams.get(index)
    if pool is None:
        dev = torch.device("spyre", index)
        pool = _host_streams[index] = [torch.Stream(dev) for _ in range(HOST_COMPUTE_STREAMS)]
    return pool


def host_compute_stream(device: Any = None) -> _SpyreStreamBase:
    index = _device_index(device)
    pool = _host_pool(index)
    i = _host_next.get(index, 0)
    _host_next[index] = (i + 1) % len(pool)
    return _SpyreStreamBase(pool[i])


def host_compute_stream_by_id(stream_id: int, device: Any = None) -> _SpyreStreamBase:
    for s in _host_pool(_device_index(device)):
        if s.stream_id == stream_id:
            return _SpyreStreamBase(s)
    raise ValueError(f"no host compute stream with id {stream_id}")


def _stream_fns() -> dict[str, Any]:
    def current_stream(device: Any = None) -> _SpyreStreamBase:
        return _SpyreStreamBase(torch.spyre.current_stream(device))

    def default_stream(device: Any = None) -> _SpyreStreamBase:
        return _SpyreStreamBase(torch.spyre.default_stream(device))

    def get_stream_from_pool(device: Any = None, priority: int = 0) -> _SpyreStreamBase:
        return _SpyreStreamBase(
            torch.Stream(torch.device("spyre", _device_index(device)), priority=priority)
        )

    def set_current_stream(stream: Any) -> None:
        torch.spyre.set_stream(getattr(stream, "_stream", stream))

    def synchronize(device: Any = None) -> None:
        torch.spyre.synchronize(device)

    def _get_default_generator(device: int = 0) -> torch.Generator:
        return torch.spyre.default_generators[int(device)]

    def get_spyre_tensor_layout(t: torch.Tensor) -> SpyreTensorLayout:
        return t.device_tensor_layout()

    def to_with_layout(t: torch.Tensor, layout: SpyreTensorLayout) -> torch.Tensor:
        return t.to(t.device if t.device.type == "spyre" else "spyre", device_layout=layout)

    def empty_with_layout(size, layout, dtype=None, device=None, pin_memory=None, fmt=None):
        if fmt not in (None, torch.contiguous_format, torch.preserve_format):
            raise RuntimeError(
                f"Spyre backend only supports contiguous memory format with a layout (got {fmt})"
            )
        return empty_in_layout(size, layout, dtype, device)

    def spyre_empty_with_layout(size, stride, dtype, layout) -> torch.Tensor:
        if [int(s) for s in stride] != _contiguous_strides(size):
            raise RuntimeError(
                f"spyre_empty_with_layout: strides {list(stride)} are not the contiguous "
                f"ones of size {list(size)}"
            )
        return empty_in_layout(size, layout, dtype, None)

    return {
        "get_spyre_tensor_layout": get_spyre_tensor_layout,
        "to_with_layout": to_with_layout,
        "empty_with_layout": empty_with_layout,
        "spyre_empty_with_layout": spyre_empty_with_layout,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "get_stream_from_pool": get_stream_from_pool,
        "set_current_stream": set_current_stream,
        "synchronize": synchronize,
        "_get_default_generator": _get_default_generator,
        "start_runtime": lambda: None,  # our cards start with the process
    }


# ------------------------------------------------ model_utils (IBM's loader)
def dma_dim_order_swapped(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 2-D weight on the card with its sticks along dim 0 (IBM's
    ``_dma_to_spyre_dim_order_swapped``: dim_order [1, 0])."""
    assert w.dim() == 2, f"expected a 2-D weight, got size {list(w.shape)}"
    dtype = dtype or w.dtype
    lay = SpyreTensorLayout(list(w.shape), _contiguous_strides(w.shape), dtype, [1, 0])
    return w.to(dtype).to("spyre", device_layout=lay)


def dma_indirect_access(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A 2-D embedding table on the card as [rows, D // stick, stick], the
    row (vocab) dim outermost, so a gather reads whole rows (IBM's
    ``_dma_to_spyre_indirect_access``); None, with a warning, when D is not a
    whole number of sticks (the caller then uses the default layout)."""
    assert w.dim() == 2, f"expected a 2-D table, got size {list(w.shape)}"
    dtype = dtype or w.dtype
    rows, d = w.shape
    se = stick_elems(dtype)
    if d % se:
        warnings.warn(
            f"embedding of width {d} is not a whole number of {se}-element sticks: "
            f"it keeps the default layout",
            UserWarning,
            stacklevel=2,
        )
        return None
    lay = SpyreTensorLayout(
        device_size=[rows, d // se, se], stride_map=[d, se, 1], device_dtype=get_device_dtype(dtype)
    )
    return w.to(dtype).to("spyre", device_layout=lay)


def _apply_overridden(module: torch.nn.Module) -> bool:
    return "_apply" in vars(module) or type(module)._apply is not torch.nn.Module._apply


def load_model_to_spyre(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """IBM's ``torch_spyre.model_utils.load_model_to_spyre``: every parameter
    and buffer to the card (floating ones as ``dtype`` when given), Linear
    weights with their sticks along dim 0, embedding tables rows-outermost.
    A module that overrides ``_apply`` governs its own subtree (as
    ``nn.Module.to``); tensors already on the card stay."""
    if dtype is not None:
        try:
            check_dtype(dtype)
        except TypeError as err:
            raise ValueError(str(err)) from None

    def convert(t: torch.Tensor, kind: str = "") -> torch.Tensor:
        if t.device.type == "spyre":
            return t
        want = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        if kind == "linear" and t.dim() == 2:
            return dma_dim_order_swapped(t.detach(), want)
        if kind == "embedding" and t.dim() == 2:
            out = dma_indirect_access(t.detach(), want)
            if out is not None:
                return out
        return t.detach().to("spyre", dtype=want)

    def visit(module: torch.nn.Module) -> None:
        if _apply_overridden(module):
            module._apply(convert)
            return
        kind = (
            "linear"
            if isinstance(module, torch.nn.Linear)
            else "embedding"
            if isinstance(module, torch.nn.Embedding)
            else ""
        )
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type != "spyre":
                new = convert(p, kind if name == "weight" else "")
                module._parameters[name] = torch.nn.Parameter(new, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = convert(b)
        for child in module.children():
            visit(child)

    with torch.no_grad():
        visit(model)
    return model


def patch_module_to_for_spyre() -> None:
    """``nn.Module.to("spyre", ...)`` loads through ``load_model_to_spyre``
    (idempotent)."""
    if getattr(torch.nn.Module.to, "_spyre_patched", False):
        return
    original = torch.nn.Module.to

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and torch.device(device).type == "spyre":
            return load_model_to_spyre(self, dtype)
        return original(self, *args, **kwargs)

    to._spyre_patched = True  # type: ignore[attr-defined]
    torch.nn.Module.to = to  # type: ignore[method-assign]


# ------------------------------------------------------------- safetensors
# safetensors' Rust side parses the device string itself and accepts only
# cpu, cuda, mps, npu, xpu, xla, mlu, musa, hpu and anon ints: neither "spyre"
# nor "privateuseone" (0.8.0: "device spyre is invalid"), and it offers no hook
# to register a backend.  So ``safe_open`` (the one function ``load_file`` and
# Hugging Face loaders call) is wrapped: a spyre device opens the file on the
# CPU and moves each tensor to the card as it is read.  Other devices go to
# safetensors unchanged.  tests/compat/test_safetensors.py fails if this stops
# working.
def _is_spyre(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "spyre"
    return isinstance(device, str) and device.split(":")[0] == "spyre"


class _SpyreSlice:
    def __init__(self, inner: Any, device: torch.device):
        self._inner, self._device = inner, device

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._inner[index].to(self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SpyreSafeOpen:
    """``safe_open(path, framework="pt", device="spyre")``: read on the CPU,
    tensors handed out on the card."""

    def __init__(self, inner: Any, device: torch.device):
        self._inner, self._device = inner, device

    def __enter__(self) -> _SpyreSafeOpen:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._inner.get_tensor(name).to(self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:  # load_file's call
        return {k: self.get_tensor(k) for k in self._inner.keys()}

    def get_slice(self, name: str) -> _SpyreSlice:
        return _SpyreSlice(self._inner.get_slice(name), self._device)

    def __getattr__(self, name: str) -> Any:  # keys, metadata, offset_keys, ...
        return getattr(self._inner, name)


def _install_safetensors() -> None:
    # Only the top-level package (the Rust binding; it imports no torch):
    # safetensors.torch imports torch, whose backend autoload runs this, before
    # its own ``from safetensors import safe_open``, which then takes the wrapper.
    try:
        import safetensors
    except ImportError:
        return
    original = safetensors.safe_open
    if getattr(original, "_spyre_wrapped", False):
        return

    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        if _is_spyre(device):
            dev = torch.device(device)
            inner = original(filename, framework=framework, device="cpu", **kwargs)
            return _SpyreSafeOpen(inner, dev)
        return original(filename, framework=framework, device=device, **kwargs)

    safe_open._spyre_wrapped = True  # type: ignore[attr-defined]
    safe_open.__doc__ = original.__doc__
    safetensors.safe_open = safe_open
    st_torch = sys.modules.get("safetensors.torch")
    if st_torch is not None and hasattr(st_torch, "safe_open"):  # imported before us
        st_torch.safe_open = safe_open


# ----------------------------------------------------------------- install
def install() -> None:
    """Put IBM's names in place (idempotent)."""
    from torch_spyre import _C
    from torch_spyre import layout as layout_mod

    layout_mod.FOREIGN.update(fields=layout_fields, device_dtype=get_device_dtype)

    for name, value in (
        ("SpyreTensorLayout", SpyreTensorLayout),
        ("DataFormats", DataFormats),
        ("get_device_dtype", get_device_dtype),
        ("get_elem_in_stick", get_elem_in_stick),
        ("get_downcast_warning", get_downcast_warning),
        ("set_downcast_warning", set_downcast_warning),
        ("SpyreDeviceState", SpyreDeviceState),
        ("SpyreStreamError", SpyreStreamError),
        ("ElementArrangement", ElementArrangement),
        ("get_device_state", get_device_state),
        ("stream_get_error", stream_get_error),
        ("stream_get_error_string", stream_get_error_string),
        ("_SpyreStreamBase", _SpyreStreamBase),
        ("host_compute_stream", host_compute_stream),
        ("host_compute_stream_by_id", host_compute_stream_by_id),
        *_stream_fns().items(),
    ):
        setattr(_C, name, value)
    spyre = torch.spyre
    memory = sys.modules.get("torch.spyre.memory") or _memory_module()
    sys.modules["torch.spyre.memory"] = memory
    for name, value in (
        ("SpyreTensorLayout", SpyreTensorLayout),
        ("DataFormats", DataFormats),
        ("get_device_dtype", get_device_dtype),
        ("get_elem_in_stick", get_elem_in_stick),
        ("get_downcast_warning", get_downcast_warning),
        ("set_downcast_warning", set_downcast_warning),
        ("memory", memory),
        ("reset_accumulated_memory_stats", memory.reset_accumulated_memory_stats),
        # IBM's allocator hooks, as torch.spyre._spyre_* (their tests call them)
        ("_spyre_get_allocator_stats", memory.memory_stats),
        ("_spyre_reset_accumulated_stats", memory.reset_accumulated_memory_stats),
        ("_spyre_reset_peak_stats", memory.reset_peak_memory_stats),
    ):
        setattr(spyre, name, value)
    _install_device_layout()
    torch.Tensor._spyre_tensor_patched = True  # IBM's marker of the patches above
    _install_fp8_ops()
    _install_safetensors()
    # IBM's runtime exports the number of visible cards; IBM's clients read it
    # (without importing torch_spyre) to decide whether a card is there.
    os.environ["AIU_WORLD_SIZE"] = str(spyre.device_count())
