"""Nested tensors on the card: the transformer encoder's padded batch.

In eval mode, given a key padding mask, ``nn.TransformerEncoder`` (and so
``nn.Transformer``) packs its batch into a nested tensor
(``torch._nested_tensor_from_mask``), runs each layer's fast path on it
(``_transformer_encoder_layer_fwd``) and pads it back
(``to_padded_tensor``): the padded positions come out as zeros.  These four
ops are the card's:

* A spyre nested tensor here is a strided nested tensor over the padded
  batch: sequence i is the first ``len_i`` rows of batch row i (storage
  offset ``i * L * E``, sizes ``(len_i, E)``, strides ``(E, 1)``).  The
  encoder's masks are left-aligned (it checks, with
  ``_nested_tensor_from_mask_left_aligned``), so no data moves.
* A layer on it is the dense layer (``ops/transformer.py``) over the padded
  batch with the key padding mask the lengths give: the padded keys take no
  part in any valid row, as in the packed computation.
* ``to_padded_tensor`` writes ``padding`` over the padded rows.

PyTorch has no public constructor of a strided nested tensor over a given
device buffer (``torch.nested.nested_tensor`` copies its pieces through the
CPU's kernels).  So the nested tensor is made by ``_nested_view_from_buffer``
redispatched to its CPU kernel, and read by ``_nested_tensor_size`` /
``_nested_tensor_storage_offsets`` / ``values`` redispatched to their
NestedTensorCPU kernels: those kernels build or read metadata only (a
``NestedTensorImpl`` whose dispatch key, NestedTensorPrivateUse1, comes from
the buffer), never the values.  ``tests/ops/test_transformer_fastpath.py``
fails if that stops holding.  Any other op on such a tensor is PyTorch's "could not run
... with arguments from the 'NestedTensorspyre' backend" error.
"""

from __future__ import annotations

import torch

from torch_spyre.ops.registry import kernel
from torch_spyre.ops.transformer import _encoder_layer

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_NESTED_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.NestedTensorCPU)
_aten = torch.ops.aten


def _wrap(buffer: torch.Tensor, lengths: list[int], rows: int, width: int) -> torch.Tensor:
    """The nested tensor of ``lengths[i]`` rows of batch row i of ``buffer``
    (the padded batch [B, rows, width], flattened)."""
    b = len(lengths)
    sizes = torch.tensor([[n, width] for n in lengths], dtype=torch.int64).reshape(b, 2)
    strides = torch.tensor([[width, 1]] * b, dtype=torch.int64).reshape(b, 2)
    offsets = torch.arange(b, dtype=torch.int64) * (rows * width)
    return _aten._nested_view_from_buffer.default.redispatch(_CPU, buffer, sizes, strides, offsets)


def _padded(nt: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(the padded batch [B, L, E] a spyre nested tensor views, its lengths)."""
    sizes = _aten._nested_tensor_size.default.redispatch(_NESTED_CPU, nt)
    offsets = _aten._nested_tensor_storage_offsets.default.redispatch(_NESTED_CPU, nt)
    strides = _aten._nested_tensor_strides.default.redispatch(_NESTED_CPU, nt)
    buffer = _aten.values.default.redispatch(_NESTED_CPU, nt)
    b = int(sizes.shape[0])
    if sizes.dim() != 2 or sizes.shape[1] != 2 or b == 0:
        raise NotImplementedError(
            "spyre: nested tensors of 2-D pieces ([len_i, E]) are held on the card, as "
            "nn.TransformerEncoder makes them; this one has sizes "
            f"{sizes.tolist()}: run it on the CPU"
        )
    width = int(sizes[0, 1])
    rows = buffer.numel() // (b * width) if width else 0
    want = torch.arange(b, dtype=torch.int64) * (rows * width)
    if (
        rows * b * width != buffer.numel()
        or not bool((sizes[:, 1] == width).all())
        or not bool((strides == torch.tensor([width, 1])).all())
        or not torch.equal(offsets, want)
    ):
        raise NotImplementedError(
            "spyre: this nested tensor is not a view of a padded batch (rows of batch row "
            "i at offset i * L * E), the only form the card holds: run it on the CPU"
        )
    return buffer.view(b, rows, width), [int(n) for n in sizes[:, 0]]


def _pad_mask(lengths: list[int], rows: int, device) -> torch.Tensor:
    """[B, L] True at the padded positions."""
    lens = torch.tensor(lengths, dtype=torch.int64).to(device)
    return torch.arange(rows, device=device)[None, :] >= lens[:, None]


def _left_aligned_lengths(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(each row's count of kept positions, whether every row keeps a prefix)."""
    lens = mask.to(torch.int64).sum(1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lens[:, None]
    return lens, bool((prefix == mask).all())


@kernel("_nested_tensor_from_mask_left_aligned.default")
def _left_aligned(t, mask):
    return _left_aligned_lengths(mask)[1]


@kernel("_nested_tensor_from_mask.default")
def _from_mask(t, mask, mask_check=True):
    if t.dim() != 3 or mask.dim() != 2 or tuple(mask.shape) != tuple(t.shape[:2]):
        raise ValueError(
            f"_nested_tensor_from_mask: a [B, L, E] tensor and a [B, L] mask, got "
            f"{list(t.shape)} and {list(mask.shape)}"
        )
    lens, aligned = _left_aligned_lengths(mask.to(torch.bool))
    if not aligned:
        # the CPU kernel's precondition (the encoder checks it before calling)
        raise ValueError(
            "_nested_tensor_from_mask: the mask must be left-aligned (each row keeps a "
            "prefix of its positions)"
        )
    b, rows, width = t.shape
    return _wrap(t.contiguous().reshape(-1), lens.cpu().tolist(), rows, width)


@kernel("_transformer_encoder_layer_fwd.default", key="NestedTensorPrivateUse1")
def _nested_encoder_layer(src, *args, mask=None, mask_type=None):
    if len(args) > 17:  # the mask passed by position
        mask, args = args[17], args[:17]
    if mask is not None:
        raise NotImplementedError(
            "spyre: a transformer encoder layer on a nested tensor with an attention mask "
            "as well (nn.TransformerEncoder takes its slow path for that): pass one mask"
        )
    x, lengths = _padded(src)
    kpm = _pad_mask(lengths, x.shape[1], x.device)
    out = _encoder_layer(x, *args, mask=kpm, mask_type=1)
    return _wrap(out.contiguous().reshape(-1), lengths, x.shape[1], x.shape[2])


@kernel("to_padded_tensor.default", key="NestedTensorPrivateUse1")
def _to_padded(nt, padding, output_size=None):
    x, lengths = _padded(nt)
    keep = ~_pad_mask(lengths, x.shape[1], x.device)
    out = torch.where(keep[:, :, None], x, torch.full((), padding, dtype=x.dtype, device=x.device))
    if output_size is not None:
        want = [int(s) for s in output_size]
        have = list(out.shape)
        if len(want) != 3 or any(w < h for w, h in zip(want, have, strict=True)):
            raise ValueError(
                f"to_padded_tensor: output_size {want} is smaller than the nested tensor's "
                f"padded size {have}"
            )
        pad = [0, want[2] - have[2], 0, want[1] - have[1], 0, want[0] - have[0]]
        if any(pad):
            out = torch.nn.functional.pad(out, pad, value=float(padding))
    return out
