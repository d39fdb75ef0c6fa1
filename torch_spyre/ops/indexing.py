"""Indexed reads and writes (row gathers and scatters) on device memory.

``index_select``, ``embedding``, ``index`` (gathers) and ``index_copy``,
``index_put`` (scatters) touch a few rows of a large tensor: an embedding
table, a KV cache.  Computing them on a host copy of the whole tensor (the
generic DMA-op path, ``runtime.fallback.run_on_values``) converts the whole
tensor both ways on every call; here only the elements moved are read or
written, by their device offsets (``SpyreTensorLayout.device_offsets``).
The values are exactly those of the generic path; the modelled time is the
generic DMA program's (``movement``), which this module does not change.

Each function returns NotImplemented for what it does not serve (accumulating
puts, boolean masks, dtype-reinterpreting views, non-adjacent index dims):
the generic path runs those.
"""

from __future__ import annotations

import torch

from torch_spyre.runtime import access


def _is_spyre(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "spyre"


def _host_index(index: torch.Tensor) -> torch.Tensor | None:
    """An integer index tensor as int64 on the host (None for a boolean mask)."""
    if index.dtype == torch.bool or index.is_floating_point():
        return None
    if index.device.type == "spyre":
        index = access.read(index)
    return index.to(torch.int64)


def _check(idx: torch.Tensor, size: int, dim: int, wrap: bool) -> torch.Tensor:
    """``idx`` within [0, size) (negative indices wrap where torch's op wraps)."""
    if idx.numel() == 0:
        return idx
    lo, hi = torch.aminmax(idx)
    lo, hi = int(lo), int(hi)
    if wrap and lo < 0:
        idx = torch.where(idx < 0, idx + size, idx)
        lo = int(idx.min())
    if lo < 0 or hi >= size:
        raise IndexError(
            f"index {lo if lo < 0 else hi} is out of bounds for dim {dim} with size {size}"
        )
    return idx


def _place(rank: int, pos: int, t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """``t``'s n dims at positions pos.. of a rank-``rank`` broadcast shape."""
    return t.reshape([1] * pos + list(t.shape) + [1] * (rank - pos - n))


def _offsets(t: torch.Tensor, first: int, index: list[torch.Tensor], wrap: bool) -> tuple:
    """Where the elements of ``t[:, ..., idx0, idx1, ..., :]`` lie: dims
    ``first .. first+len(index)-1`` indexed by broadcast integer tensors, every
    other dim whole; shaped as advanced indexing shapes its result.

    Returns ("device", offsets into t's device memory) when t is its whole
    base (per-dim offset tables of its layout: a few ops), else ("host",
    element offsets into its storage's logical base)."""
    index = [_check(i, t.shape[first + k], first + k, wrap) for k, i in enumerate(index)]
    bshape = torch.broadcast_shapes(*(i.shape for i in index))
    last = first + len(index)
    nb = len(bshape)
    rank = first + nb + (t.dim() - last)
    whole = [(d, d if d < first else d - len(index) + nb) for d in range(t.dim())]
    whole = [(d, p) for d, p in whole if not first <= d < last]
    layout = access.storage_layout(t)
    if access.covers_base(t, layout):
        tabs = layout.dim_offsets
        offs = torch.zeros((), dtype=torch.int64)
        for d, pos in whole:
            offs = offs + _place(rank, pos, tabs[d])
        for k, idx in enumerate(index):
            offs = offs + _place(rank, first, tabs[first + k][idx.expand(bshape)], nb)
        return "device", offs
    offs = torch.full((), t.storage_offset(), dtype=torch.int64)
    for d, pos in whole:
        step = torch.arange(t.shape[d], dtype=torch.int64) * t.stride(d)
        offs = offs + _place(rank, pos, step)
    for k, idx in enumerate(index):
        offs = offs + _place(rank, first, idx.expand(bshape) * t.stride(first + k), nb)
    return "host", offs


def _laid_out(t: torch.Tensor) -> bool:
    """True when ``t``'s elements are those of its storage's layout (no dtype view)."""
    return access.storage_layout(t).dtype == t.dtype


def _gather(t: torch.Tensor, first: int, index: list[torch.Tensor], wrap: bool) -> torch.Tensor:
    kind, offs = _offsets(t, first, index, wrap)
    return access.read_elements(t, offs, device=kind == "device")


def _scatter(t: torch.Tensor, first: int, index: list[torch.Tensor], values, wrap: bool):
    kind, offs = _offsets(t, first, index, wrap)
    if _is_spyre(values):
        values = access.read(values)
    access.write_elements(t, offs, values.to(t.dtype).expand(offs.shape), device=kind == "device")


def _new(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=values.dtype, device=device)
    access.write(out, values)
    return out


def index_select(x, dim: int, index):
    idx = _host_index(index) if _is_spyre(x) else None
    if idx is None or idx.dim() > 1 or not _laid_out(x):
        return NotImplemented
    dim %= max(x.dim(), 1)
    if x.dim() == 0:
        return NotImplemented
    return _new(_gather(x, dim, [idx.reshape(-1)], wrap=False), x.device)


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    idx = _host_index(indices) if _is_spyre(weight) and weight.dim() == 2 else None
    if idx is None or not _laid_out(weight):
        return NotImplemented
    rows = _gather(weight, 0, [idx.reshape(-1)], wrap=False)
    return _new(rows.reshape(*idx.shape, weight.shape[1]), weight.device)


def _split_indices(x: torch.Tensor, indices) -> tuple[int, list[torch.Tensor]] | None:
    """(first indexed dim, host index tensors) for adjacent integer indices."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims or dims != list(range(dims[0], dims[-1] + 1)) or len(indices) > x.dim():
        return None
    host = [_host_index(indices[d]) for d in dims]
    if any(h is None for h in host):
        return None
    return dims[0], host  # type: ignore[return-value]


def index(x, indices):
    got = _split_indices(x, indices) if _is_spyre(x) and _laid_out(x) else None
    if got is None:
        return NotImplemented
    return _new(_gather(x, *got, wrap=True), x.device)


def index_put_(x, indices, values, accumulate=False, unsafe=False):
    if accumulate or not _is_spyre(x) or not _laid_out(x):
        return NotImplemented
    got = _split_indices(x, indices)
    if got is None:
        return NotImplemented
    _scatter(x, *got, values, wrap=True)
    return x


def index_copy_(x, dim: int, index, source):
    idx = _host_index(index) if _is_spyre(x) else None
    if idx is None or idx.dim() > 1 or not _laid_out(x) or x.dim() == 0:
        return NotImplemented
    dim %= x.dim()
    # index_copy's source is shaped like x with `dim` replaced by the index
    _scatter(x, dim, [idx.reshape(-1)], source, wrap=False)
    return x


def index_copy_out(x, dim: int, index, source, *, out):
    if out is not x:  # the functional form: a copy of x with the rows replaced
        return NotImplemented
    return index_copy_(x, dim, index, source)


#: aten overload -> implementation (args, kwargs as the schema gives them)
KERNELS = {
    "index_select.default": index_select,
    "embedding.default": embedding,
    "index.Tensor": index,
    "_index_put_impl_.default": index_put_,
    "index_put_.default": index_put_,
    "index_copy_.default": index_copy_,
    "index_copy.out": index_copy_out,
}
