"""Reading and writing the values of spyre tensors through their stick layout.

A spyre tensor is a plain ``torch.Tensor`` with host (logical) sizes, strides
and storage offset.  Its storage's *logical* bytes are those of the base
tensor the storage was made for, contiguous; in device memory they are laid
out in sticks by the storage's :class:`SpyreTensorLayout`.  A storage made by
the allocator directly (``torch.UntypedStorage(n, device="spyre")``, loading a
checkpoint) has no layout and is linear: bytes in order, padded to a stick.

Everything here runs on host memory that *is* the simulated card's memory
(``_C._device_bytes``); only the runtime and the simulator use this module.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from torch_spyre import _C, _card
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.runtime import cards
from torch_spyre.sim.hostviews import VIEWS

_DTYPES = {
    "Half": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float": torch.float32,
    "Float8_e4m3fn": torch.float8_e4m3fn,
    "Float8_e5m2": torch.float8_e5m2,
    "Char": torch.int8,
    "Byte": torch.uint8,
    "Short": torch.int16,
    "Int": torch.int32,
    "Long": torch.int64,
    "Bool": torch.bool,
    "ComplexFloat": torch.complex64,
}

# Below this fraction of its base, a view is gathered stick by stick instead
# of converting the whole base.
_GATHER_FRACTION = 0.25


@lru_cache(maxsize=4096)
def _layout(host: tuple, device: tuple, dim_map: tuple, dtype: str) -> SpyreTensorLayout:
    return SpyreTensorLayout(host, device, dim_map, _DTYPES[dtype])


_by_id: dict[int, SpyreTensorLayout] = {}


def storage_layout(t: torch.Tensor) -> SpyreTensorLayout:
    """The stick layout of the storage behind spyre tensor ``t``."""
    lid = _C._layout_id(t)
    if lid >= 0:
        lay = _by_id.get(lid)
        if lay is None:
            lay = _by_id[lid] = _layout_from_info(t)
        return lay
    return _layout_from_info(t)


def _layout_from_info(t: torch.Tensor) -> SpyreTensorLayout:
    info = _C._layout_of(t)
    if info is None:
        if t.untyped_storage().nbytes() == 0:  # nothing allocated: nothing laid out yet
            return SpyreTensorLayout.default(tuple(t.shape), t.dtype)
        return SpyreTensorLayout.default((t.untyped_storage().nbytes(),), torch.uint8)
    host, device, dim_map, dtype = info
    return _layout(tuple(host), tuple(device), tuple(dim_map), dtype)


def device_tensor(t: torch.Tensor, layout: SpyreTensorLayout | None = None) -> torch.Tensor:
    """The device memory of ``t``'s storage as a row-major ``device_size`` CPU tensor.

    It aliases the card's memory: writes to it are writes to the device.
    """
    layout = layout or storage_layout(t)
    if layout.nbytes == 0:
        return torch.empty(layout.device_size, dtype=layout.dtype)
    return _C._device_tensor(t, layout.dtype, list(layout.device_size))


def covers_base(t: torch.Tensor, layout: SpyreTensorLayout) -> bool:
    """True when ``t`` is its storage's whole base tensor in ``layout``."""
    return _covers_base(t, layout)


def _covers_base(t: torch.Tensor, layout: SpyreTensorLayout) -> bool:
    return (
        t.dtype == layout.dtype
        and t.storage_offset() == 0
        and tuple(t.shape) == layout.host_size
        and t.is_contiguous()
    )


def _host_offsets(t: torch.Tensor) -> torch.Tensor:
    """Element offsets into the base of every element of view ``t``, in order."""
    offs = torch.full((), t.storage_offset(), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        offs = offs + (torch.arange(size, dtype=torch.int64) * stride).view(shape)
    return offs.expand(t.shape).reshape(-1)


def _logical_base(t: torch.Tensor, layout: SpyreTensorLayout) -> torch.Tensor:
    """The whole base, contiguous on the host, as flat bytes."""
    return layout.to_host(device_tensor(t, layout)).reshape(-1).view(torch.uint8)


def _byte_view(base_bytes: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided view over the base's logical bytes."""
    usable = base_bytes.numel() // t.element_size() * t.element_size()
    flat = base_bytes[:usable].view(t.dtype)
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def read(t: torch.Tensor, device_values: bool = False) -> torch.Tensor:
    """The values of spyre tensor ``t`` as a new contiguous CPU tensor.

    ``device_values``: as the card holds them, for moves within the card (a
    DL16 card's 16-bit floats then come back in fp32: fp16 cannot hold their
    range); otherwise in ``t.dtype``, as a copy to the host gives them.
    """
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    layout = storage_layout(t)
    wide = torch.float32 if device_values and layout.dl16 and t.dtype == layout.dtype else None
    if _covers_base(t, layout):
        return layout.to_host(device_tensor(t, layout), wide)
    if t.dtype == layout.dtype and t.numel() < _GATHER_FRACTION * layout.numel:
        offsets = layout.device_offsets(_host_offsets(t))
        raw = device_tensor(t, layout).reshape(-1)[offsets].view(t.shape)
        return layout.values(raw, wide)
    if t.dtype == layout.dtype:
        base = layout.to_host(device_tensor(t, layout), wide).reshape(-1)
        return base.as_strided(t.shape, t.stride(), t.storage_offset()).contiguous()
    return _byte_view(_logical_base(t, layout), t).contiguous()


def write(t: torch.Tensor, values: torch.Tensor, device_values: bool = False) -> None:
    """Store CPU ``values`` (broadcast to ``t``'s shape, cast) into spyre tensor ``t``.

    ``device_values``: ``values`` are as ``read(..., device_values=True)`` gives
    them (not first rounded to ``t.dtype``).
    """
    if t.numel() == 0:
        return
    layout = storage_layout(t)
    keep = device_values and layout.dl16 and values.dtype == torch.float32
    values = values.to(dtype=torch.float32 if keep else t.dtype).expand(t.shape)
    dev = device_tensor(t, layout)
    try:
        _write(t, values, layout, dev)
    finally:
        VIEWS.written(dev)  # the executor's host views of this block are stale now


def _write(t: torch.Tensor, values: torch.Tensor, layout: SpyreTensorLayout, dev) -> None:
    if _covers_base(t, layout):
        layout.store(dev, values)
        return
    if t.dtype == layout.dtype and t.numel() < _GATHER_FRACTION * layout.numel:
        offsets = layout.device_offsets(_host_offsets(t))
        dev.reshape(-1)[offsets] = layout.raw(values.reshape(-1))
        return
    if t.dtype == layout.dtype:
        # the rest of the base keeps its device values (a DL16 card's range)
        base = layout.to_host(dev, torch.float32 if layout.dl16 else None)
        base.reshape(-1).as_strided(t.shape, t.stride(), t.storage_offset()).copy_(values)
        layout.store(dev, base)
        return
    base_bytes = _logical_base(t, layout)
    _byte_view(base_bytes, t).copy_(values)
    base = base_bytes.view(layout.dtype)[: layout.numel].view(layout.host_size)
    layout.store(dev, base)


def fill(t: torch.Tensor, value: bool | int | float) -> bool:
    """Store the number ``value`` into every element of ``t`` without reading
    it: one pass over device memory, none for zeros over a whole large block
    (SmolLM2's 256 MiB KV cache zeroed in ~0.01 s; the general path converted
    it to the host and back, and the engine's log showed 0.85 s there).  Only
    when ``t`` is all of its storage; False otherwise (the caller takes the
    general path).  The bytes are exactly those ``write`` stores."""
    layout = storage_layout(t)
    if t.numel() == 0 or not _covers_base(t, layout):
        return False
    value = torch.full((1,), value, dtype=t.dtype)  # rounded as write rounds it
    raw = layout.raw(value)
    dev = device_tensor(t, layout)
    try:
        if not raw.view(torch.uint8).any():  # all-zero bits: padding is zero too
            # the card drops a whole large block's pages (they read back zero)
            # instead of touching each: a fresh KV cache costs no page faults
            if not _card.zero_range(dev.data_ptr(), dev.numel() * dev.element_size()):
                dev.zero_()
        else:  # one store pass of the value, not read first
            layout.store(dev, value.reshape(()).expand(layout.host_size))
    finally:
        VIEWS.written(dev)
    return True


def read_elements(t: torch.Tensor, offsets: torch.Tensor, device: bool = False) -> torch.Tensor:
    """The values of the storage elements of ``t`` at ``offsets``, shaped like
    ``offsets``: only those elements are read.  ``offsets`` are element offsets
    into the storage's logical base, or into device memory with ``device``;
    ``t.dtype`` is the layout's."""
    layout = storage_layout(t)
    if not device:
        offsets = layout.device_offsets(offsets.reshape(-1)).view(offsets.shape)
    return layout.values(device_tensor(t, layout).reshape(-1)[offsets])


def write_elements(
    t: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, device: bool = False
) -> None:
    """Store ``values`` (shaped like ``offsets``) into the storage elements of ``t``
    at ``offsets`` (as in ``read_elements``): only those elements are written."""
    layout = storage_layout(t)
    if not device:
        offsets = layout.device_offsets(offsets.reshape(-1)).view(offsets.shape)
    dev = device_tensor(t, layout)
    try:
        dev.reshape(-1)[offsets] = layout.raw(values)
    finally:
        VIEWS.written(dev)


def device_nbytes(t: torch.Tensor) -> int:
    """Bytes a copy of ``t`` moves: whole sticks of device memory (all of its
    storage's sticks, padding included, when ``t`` is all of its storage in
    another shape: a folded or sparse-stick layout)."""
    layout = storage_layout(t)
    if _covers_base(t, layout) or _whole_storage_view(t, layout):
        return layout.nbytes
    return math.ceil(t.numel() * t.element_size() / 128) * 128


def _whole_storage_view(t: torch.Tensor, layout: SpyreTensorLayout) -> bool:
    return (
        t.dtype == layout.dtype
        and t.numel() == layout.numel
        and t.storage_offset() == 0
        and t.is_contiguous()
    )


def fold_segments(t: torch.Tensor) -> int:
    """Extra host segments a copy of ``t`` gathers its sticks from: when ``t``
    (all of its storage) is stored folded, its elements in order packed into
    sticks across rows, each row that crosses a stick boundary is one more
    piece (0 for a layout whose sticks each hold one row's elements)."""
    layout = storage_layout(t)
    if (
        t.dim() < 2
        or len(layout.host_size) != 1
        or tuple(t.shape) == layout.host_size
        or not _whole_storage_view(t, layout)
    ):
        return 0
    row, se = t.shape[-1], layout.stick_elems
    if row == 0 or row % se == 0:
        return 0
    start = torch.arange(t.numel() // row, dtype=torch.int64) * row
    return int(((start // se) != ((start + row - 1) // se)).sum())


def is_whole_linear(t: torch.Tensor) -> bool:
    """True when ``t`` is all of a linear storage (one made without a tensor:
    torch.load, unpickling, Inductor's cached constants), contiguous."""
    return (
        _C._layout_of(t) is None
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def adopt_default(t: torch.Tensor) -> None:
    """The linear storage of ``t`` (``is_whole_linear``) takes the default stick
    layout of ``t``, in place: the values are re-laid on the card once (a
    restickify DMA, modelled as such) and every tensor of the storage reads
    them through the new layout from then on, instead of a re-lay per use."""
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    write(fresh, read(t, device_values=True), device_values=True)
    _C._swap_blocks(t, fresh)  # fresh now holds the linear block, freed with it
    cards.record_transfer(t.device.index or 0, "d2d", device_nbytes(t))


def relinearize(t: torch.Tensor) -> None:
    """Turn the storage of ``t`` into a linear one, keeping its logical bytes.

    Needed before the storage grows (resize_), which copies bytes in order.
    """
    if _C._layout_of(t) is None:
        return
    layout = storage_layout(t)
    logical = _logical_base(t, layout)
    _C._drop_layout(t)
    raw = _C._device_bytes(t)
    VIEWS.written(raw)
    raw.zero_()
    raw[: logical.numel()].copy_(logical)
