"""Registers spyre with PyTorch through its public out-of-tree device path."""

from __future__ import annotations

import torch

_done = False
_libs: list[torch.library.Library] = []


def register() -> None:
    global _done
    if _done:
        return
    # the C++ extension registers the allocator, guard, hooks, generator and
    # the metadata-only kernels when it is loaded
    try:
        from torch_spyre import _C  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "torch_spyre's C++ extensions (torch_spyre._C and torch_spyre._card) are not "
            "built in this checkout: "
            "run `bash scripts/install.sh` (or `python setup.py build_ext --inplace`). "
            "To import torch without torch_spyre, set TORCH_DEVICE_BACKEND_AUTOLOAD=0."
        ) from err
    from torch_spyre.runtime import cards, copies, device_module, printing

    torch.utils.rename_privateuse1_backend("spyre")
    torch._register_device_module("spyre", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    cards.init()
    printing.install()

    aten = torch.library.Library("aten", "IMPL")
    for name, fn in (
        ("copy_", copies.copy_),
        ("_copy_from", copies._copy_from),
        ("_copy_from_and_resize", copies._copy_from_and_resize),
        ("_local_scalar_dense", copies._local_scalar_dense),
        ("resize_", copies.resize_),
    ):
        aten.impl(name, entry(fn), "PrivateUse1")
    # No extension point exists for per-device Tensor methods; IBM's stack
    # adds this one the same way, so user code is portable between the two.
    torch.Tensor.device_tensor_layout = _device_tensor_layout
    _libs.append(aten)
    _done = True


def entry(fn):
    """A Python kernel as PyTorch's dispatcher calls it: with Dynamo off.

    A ``torch.compile``d function that breaks its graph runs the rest eagerly
    with Dynamo's frame hook still installed, and every Python frame a spyre
    kernel enters (the simulator's executor, layouts, copies) would be
    compiled in turn, recompiled for every shape until Dynamo's cache limit:
    minutes for MPT's tiny config in the architecture sweep, for no gain (the
    kernel is already the device's program).  ``torch.compiler.disable`` is
    the public way to say a function is not to be traced; Dynamo tracing a
    model never calls these (it runs ops on fake tensors)."""
    return torch.compiler.disable(fn, recursive=True)


def _device_tensor_layout(self: torch.Tensor):
    """The stick layout of the device storage behind this spyre tensor (None
    for a tensor on another device: it has no stick layout; as IBM's)."""
    from torch_spyre.runtime.access import storage_layout

    if self.device.type != "spyre":
        return None
    return storage_layout(self)
