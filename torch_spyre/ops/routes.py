"""The ``spyre::`` ops the compiler routes FX nodes to (``compiler/passes.py``).

Gathers, scatters, index writes, concatenations, pads and rolls that no
kernel program expresses become these ops: Inductor keeps them as fallback
kernels, and the compiled code calls them, which runs the device's eager
kernel.  They are defined here, with the other device ops, at ``import
torch_spyre`` (``ops.register``): compiled code that calls them may run in a
process that never compiles (an AOTInductor package, ``runtime/aoti.py``;
an Inductor cache hit).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("spyre::embedding", mutates_args=())
def embedding(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``F.embedding(indices, weight)`` by the device's eager kernel."""
    return torch.nn.functional.embedding(indices, weight)


@embedding.register_fake
def _(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*indices.shape, weight.shape[-1]))


@torch.library.custom_op("spyre::index_put_", mutates_args=("x",))
def index_put_(
    x: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor, accumulate: bool
) -> None:
    """``x.index_put_(indices, values, accumulate)`` by the device's eager kernel, in place."""
    torch.ops.aten.index_put_.default(x, indices, values, accumulate)


@torch.library.custom_op("spyre::gather", mutates_args=())
def gather(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``torch.gather(x, dim, index)`` by the device's eager kernel (a DMA program)."""
    return torch.gather(x, dim, index)


@gather.register_fake
def _(x, dim, index):
    return x.new_empty(index.shape)


@torch.library.custom_op("spyre::scatter", mutates_args=())
def scatter(
    x: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    src: torch.Tensor | None,
    value: float,
    reduce: str,
    include_self: bool,
) -> torch.Tensor:
    """``scatter`` / ``scatter_add`` / ``scatter_reduce`` (an index written from
    data) by the device's eager kernels; ``src=None`` scatters ``value``."""
    if src is None:
        out = torch.ops.aten.scatter.value(x, dim, index, value)
    elif reduce == "none":
        out = torch.ops.aten.scatter.src(x, dim, index, src)
    elif reduce == "add":
        out = torch.ops.aten.scatter_add.default(x, dim, index, src)
    else:
        out = torch.ops.aten.scatter_reduce.two(
            x, dim, index, src, reduce, include_self=include_self
        )
    return out.contiguous()


@scatter.register_fake
def _(x, dim, index, src, value, reduce, include_self):
    return x.new_empty(x.shape)


@torch.library.custom_op("spyre::cat", mutates_args=())
def cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(pieces, dim)`` by the device's eager kernel (a DMA program):
    along an outer dim (a KV cache grown by a token) or of pieces whole sticks
    wide along the stick dim (the logits of a chunked LM head) each piece's
    sticks move to their offset, no lane shifts; a piece not whole sticks
    wide along a wide stick dim (gpt-oss's attention sinks) is shifted into
    its lanes by that kernel."""
    return torch.cat(pieces, dim)


@cat.register_fake
def _(pieces, dim):
    return torch.cat([torch.empty_like(p) for p in pieces], dim)


@torch.library.custom_op("spyre::pad", mutates_args=())
def pad(x: torch.Tensor, pad: list[int], value: float) -> torch.Tensor:
    """``F.pad(x, pad, value=value)`` by the device's eager kernel (a DMA
    program): a pad of an outer dim, which Inductor writes as masked loads of
    shifted rows (no program expresses them)."""
    return torch.ops.aten.constant_pad_nd.default(x, pad, value)


@pad.register_fake
def _(x, pad, value):
    return torch.ops.aten.constant_pad_nd.default(x, pad, value)


@torch.library.custom_op("spyre::roll", mutates_args=())
def roll(x: torch.Tensor, shifts: list[int], dims: list[int]) -> torch.Tensor:
    """``torch.roll`` by the device's eager kernel (a DMA program)."""
    return torch.roll(x, shifts, dims)


@roll.register_fake
def _(x, shifts, dims):
    return torch.empty_like(x)


@torch.library.custom_op("spyre::index", mutates_args=())
def index(x: torch.Tensor, indices: list[torch.Tensor | None]) -> torch.Tensor:
    """``x[indices]`` with integer index tensors (a gather: ``index_select``, a
    page read by a device index) by the device's eager kernel.  Contiguous: the
    strides advanced indexing gives depend on the input's (a transposed input),
    and the fake must promise what the kernel returns."""
    return torch.ops.aten.index.Tensor(x, indices).contiguous()


@index.register_fake
def _(x, indices):
    return torch.ops.aten.index.Tensor(x, indices).contiguous()  # integer indices: shapes only
