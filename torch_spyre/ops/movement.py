"""Data-movement ops (cat, gather, scatter, index, pad, flip, roll, tril, ...),
fills, scans and the random generators as DMA kernels of the card.

Their values are computed by torch on the card's memory (no PCIe copy is
modelled: the data never leaves the card); their time is that of a DMA
program moving every output byte through the LX once, read and written,
which is what these ops cost on a machine whose cores do no arithmetic for
them.  The program is named after the op, so the profiler shows the kernel.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from torch_spyre.kernels import eager as programs
from torch_spyre.ops import indexing
from torch_spyre.runtime import access, launch
from torch_spyre.runtime.fallback import run_on_values

#: aten base names served here
MOVEMENT = {
    # gathers, scatters, concatenation, padding, reordering, masking
    "cat", "stack", "index_select", "gather", "scatter", "scatter_add", "scatter_reduce",
    "index_add", "index_copy", "index_fill", "index", "index_put", "_index_put_impl",
    "_unsafe_index", "embedding", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "reflection_pad3d", "replication_pad3d", "tril", "triu", "flip", "roll", "repeat",
    "repeat_interleave", "masked_fill", "masked_scatter", "masked_select", "take", "put",
    "diag", "diag_embed", "nonzero", "where", "one_hot", "im2col", "channel_shuffle",
    "pixel_shuffle", "pixel_unshuffle", "slice_scatter", "select_scatter",
    "diagonal_scatter", "as_strided_scatter", "tril_indices", "triu_indices",
    # copies of views
    "clone", "_to_copy", "alias_copy", "view_copy", "permute_copy", "expand_copy", "t_copy",
    "transpose_copy", "slice_copy", "select_copy", "split_copy", "unbind_copy",
    "squeeze_copy", "unsqueeze_copy", "as_strided_copy", "diagonal_copy", "narrow_copy",
    "unfold_copy",
    # fills and factories: one store pass
    "fill", "zero", "arange", "linspace", "logspace", "eye", "full", "ones", "zeros",
    "new_zeros", "new_ones", "new_full", "new_empty", "empty_like",
    # scans: one pass of the vector unit along the row
    "cumsum", "cumprod", "cummax", "cummin", "_cummax_helper", "_cummin_helper",
    "index_reduce",
    # random generators (the card's generator state is the spyre Generator)
    "uniform", "normal", "bernoulli", "random", "exponential", "geometric", "cauchy",
    "log_normal", "randperm", "multinomial", "native_dropout",
}  # fmt: skip


_names: dict = {}


def _fill(t: torch.Tensor, value) -> torch.Tensor:
    """``fill_`` of a whole storage with a number: device memory written in
    place, not read first (``access.fill``); anything else: NotImplemented."""
    if isinstance(value, bool | int | float) and access.fill(t, value):
        return t
    return NotImplemented


#: ops served without converting their operands to the host and back
_FAST = {
    **indexing.KERNELS,
    "fill_.Scalar": _fill,
    "zero_.default": lambda t: _fill(t, 0),
}


def _scattered_bytes(name: str, args: tuple, kwargs: dict) -> int | None:
    """Bytes an in-place row scatter writes: its source, not the whole destination
    it returns (a KV-cache update moves the new keys, not the cache).  None for
    every other op: the DMA program moves its whole output."""
    if name in ("index_copy_.default", "index_copy.out"):
        x, source = args[0], args[3]
        if name == "index_copy.out" and kwargs.get("out") is not x:
            return None
        return source.numel() * x.element_size()
    if name in ("_index_put_impl_.default", "index_put_.default"):
        x, indices = args[0], args[1]
        meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
        # an index_put index of None is a whole dim (a Python index of None
        # would be a new axis)
        idx = [slice(None) if i is None else torch.empty(i.shape, dtype=i.dtype, device="meta")
               for i in indices]  # fmt: skip
        try:
            return meta[tuple(idx)].numel() * x.element_size()
        except (IndexError, RuntimeError):
            return None
    return None


def run(op, args: tuple, kwargs: dict):
    name = _names.get(op)
    if name is None:
        name = _names[op] = str(op).removeprefix("aten.")
    fast = _FAST.get(name)
    out = fast(*args, **kwargs) if fast is not None else NotImplemented
    if out is NotImplemented:
        out = run_on_values(op, args, kwargs, pcie=False)
    moved = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not moved:
        return out
    nbytes = _scattered_bytes(name, args, kwargs)
    if nbytes is None:
        nbytes = sum(t.numel() * t.element_size() for t in moved)
    device = moved[0].device.index
    if nbytes:
        base = op._schema.name.split("::")[-1]
        key = ("dma", base, nbytes)
        k = launch.kernel(
            key,
            lambda: launch.Kernel(
                programs.pointwise(
                    "copy",
                    (nbytes,),
                    torch.uint8,
                    [((nbytes,), torch.uint8)],
                    name=f"{base}_{nbytes}B",
                )
            ),
        )
        if k.program is not None:
            k.model_only(device)
    return out
