"""Spyre tensors as kernel operands: whole tensors in the default stick layout.

A kernel program reads and writes whole operands through their layouts.  A
tensor that already is its storage's whole base in the default layout is used
in place (no copy); a tensor that is all of a linear storage (torch.load,
unpickling, Inductor's cached constants) is re-laid in place once, the
storage keeping the default layout; anything else (a strided view, a dtype
view) is first re-laid on the card into a fresh tensor.  Each re-lay is
modelled as a device-to-device DMA of its sticks.
"""

from __future__ import annotations

import functools

import torch

from torch_spyre import _C
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.runtime import access, cards


def is_whole_default(t: torch.Tensor) -> bool:
    """True when ``t`` is all of its storage, in the default stick layout."""
    return _whole_layout(t) is not None


def _whole_layout(t: torch.Tensor) -> SpyreTensorLayout | None:
    if t.storage_offset() != 0 or not t.is_contiguous():
        return None
    lay = access.storage_layout(t)
    if lay.dtype == t.dtype and lay.host_size == tuple(t.shape):
        # a storage allocated in another layout (device_layout=) is no default operand
        default = SpyreTensorLayout.default(lay.host_size, lay.dtype)
        if lay.dim_map == default.dim_map and lay.device_size == default.device_size:
            return lay
    return None


def memory(t: torch.Tensor) -> torch.Tensor:
    """The device memory of ``t`` as a whole default-layout operand (re-laid
    first if it is not one)."""
    mem = _C._whole_operand(t)  # the common case, in one call
    if mem is not None:
        return mem
    lay = _whole_layout(t)
    if lay is None:
        if not _adopted(t):
            t = relaid(t)
        lay = access.storage_layout(t)
    return access.device_tensor(t, lay)


def base_of(t: torch.Tensor) -> torch.Tensor | None:
    """The whole base tensor of ``t`` when ``t`` is all of it, viewed contiguously
    in another shape (a reshape of a whole tensor); None otherwise.

    Kernels then run in the base's shape, so reshapes never move data.
    """
    if t.storage_offset() != 0 or not t.is_contiguous():
        return None
    lay = access.storage_layout(t)
    if (
        lay.dtype != t.dtype
        or lay.numel != t.numel()
        or lay != SpyreTensorLayout.default(lay.host_size, lay.dtype)
    ):
        return None
    if lay.host_size == tuple(t.shape):
        return t
    return t.view(lay.host_size)


@functools.lru_cache(maxsize=256)
def same_bytes(a: tuple[int, ...], b: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether two shapes of the same elements have the same device bytes in
    their default layouts (a token-major [T, H, D] and [T, H * D] when D is
    whole sticks)."""
    la, lb = SpyreTensorLayout.default(a, dtype), SpyreTensorLayout.default(b, dtype)
    if la.numel != lb.numel or la.device_numel != lb.device_numel:
        return False
    i = torch.arange(la.numel, dtype=torch.int64)
    return torch.equal(la.device_offsets(i), lb.device_offsets(i))


def in_shape(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The whole base of ``t`` when its device bytes are those of a whole
    default-layout tensor of ``shape`` (so a program declaring that operand
    reads it in place); None otherwise."""
    base = base_of(t)
    if base is None or not same_bytes(tuple(base.shape), tuple(shape), t.dtype):
        return None
    return base


def row_blocks(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """The device memory of the 2-D tensor whose consecutive row blocks are
    ``ws`` (vLLM's merged ``qkv_proj`` / ``gate_up_proj`` sliced apart: a
    program reads every block in place through row offsets); None when they
    are not that, all of one default-layout storage in order."""
    if len(ws) < 2 or any(w.dim() != 2 or not w.is_contiguous() for w in ws):
        return None
    k = ws[0].shape[1]
    ptr = ws[0].untyped_storage().data_ptr()
    at = 0
    for w in ws:
        if w.shape[1] != k or w.untyped_storage().data_ptr() != ptr or w.storage_offset() != at:
            return None
        at += w.numel()
    lay = access.storage_layout(ws[0])
    if lay != SpyreTensorLayout.default((at // k, k), ws[0].dtype):
        return None
    return access.device_tensor(ws[0], lay)


def relaid(t: torch.Tensor) -> torch.Tensor:
    """A fresh default-layout copy of ``t`` made on the card (a restickify DMA)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.numel():
        access.write(out, access.read(t, device_values=True), device_values=True)
        cards.record_transfer(t.device.index, "d2d", access.device_nbytes(out))
    return out


def _adopted(t: torch.Tensor) -> bool:
    """When ``t`` is all of a linear storage (loaded, unpickled): the storage
    takes ``t``'s default layout, once, and ``t`` is used in place from then on."""
    if not access.is_whole_linear(t):
        return False
    access.adopt_default(t)
    return True


def whole(t: torch.Tensor) -> torch.Tensor:
    return t if is_whole_default(t) or _adopted(t) else relaid(t)


def operand_layout(t: torch.Tensor) -> SpyreTensorLayout:
    """The layout a program sees for whole tensor ``t`` (scalars as 1-element vectors,
    which have the same device bytes)."""
    return SpyreTensorLayout.default(tuple(t.shape) or (1,), t.dtype)


def device_memory(t: torch.Tensor) -> torch.Tensor:
    """The device memory of whole tensor ``t`` (see access.device_tensor)."""
    mem = _C._whole_operand(t)
    return mem if mem is not None else access.device_tensor(t)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """A new default-layout spyre tensor and its device memory (a kernel's output)."""
    t, mem = _C._empty_operand(list(shape), dtype, device.index or 0)
    return t, mem if mem is not None else access.device_tensor(t)
