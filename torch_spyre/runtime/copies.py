"""Copies between host and device and between cards, through stick layouts.

Every copy is modelled on the card(s) it touches: host<->device over PCIe,
device<->device within a card over LPDDR5, across cards through the host.
"""

from __future__ import annotations

import torch

from torch_spyre.runtime import access, cards


def _is_spyre(t: torch.Tensor) -> bool:
    return t.device.type == "spyre"


def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if self.numel() == 0:
        return self
    try:
        if src.shape != self.shape:
            src.expand(self.shape)  # metadata only: checks broadcastability
    except RuntimeError:
        raise RuntimeError(
            f"copy_: the source of shape {list(src.shape)} cannot be broadcast to the "
            f"destination of shape {list(self.shape)}"
        ) from None
    if _is_spyre(src):
        values = access.read(src)  # the bytes' values: a conjugate view's bit not applied
        if src.is_conj():
            values = values.conj_physical()
        if not _is_spyre(self) or self.device != src.device:
            cards.record_transfer(
                src.device.index,
                "d2h",
                access.device_nbytes(src),
                segments=access.fold_segments(src),
            )
    else:
        values = src.to("cpu")
    if _is_spyre(self):
        if self.is_conj():  # the bytes of a conjugate view hold the conjugate
            values = values.resolve_conj().conj_physical()
        access.write(self, values)
        if _is_spyre(src) and src.device == self.device:
            kind = "d2d"
        else:
            kind = "h2d"
        cards.record_transfer(
            self.device.index,
            kind,
            access.device_nbytes(self),
            segments=access.fold_segments(self),
        )
    else:
        self.copy_(values)
    return self


def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return copy_(dst, self, non_blocking)


def _copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != self.shape:
        dst.resize_(self.shape)
    return copy_(dst, self)


def _local_scalar_dense(self: torch.Tensor):
    value = access.read(self).item()
    cards.record_transfer(self.device.index, "d2h", access.device_nbytes(self))
    return value


def resize_(self: torch.Tensor, size, memory_format=None) -> torch.Tensor:
    """resize_: metadata only when the storage is big enough, else grow it.

    Growing keeps the storage's logical bytes, as PyTorch does; a storage with
    a stick layout is made linear first so a byte-order copy stays correct.
    """
    from torch_spyre import _C

    numel = 1
    for s in size:
        if s < 0:
            raise RuntimeError(f"resize_: negative dimension {s} in size {list(size)}")
        numel *= s
    needed = (self.storage_offset() + numel) * self.element_size()
    if numel and needed > self.untyped_storage().nbytes():
        access.relinearize(self)
    _C._resize_metadata(self, list(size))
    if memory_format is not None and memory_format != torch.preserve_format:
        self.as_strided_(self.shape, _strides_for(self, memory_format))
    return self


def _strides_for(t: torch.Tensor, memory_format: torch.memory_format) -> tuple[int, ...]:
    return torch.empty(t.shape, device="meta").contiguous(memory_format=memory_format).stride()
