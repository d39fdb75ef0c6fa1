"""Printing spyre tensors.

Why a patch: ``torch._tensor_str`` formats a tensor by converting it to
float64 on its own device, and copies to the CPU first only for a fixed list
of device types (xla, lazy, ipu, mtia) with no hook for others.  spyre stores
no float64, so without this wrapper ``print(t)`` would fail.  The wrapper
formats a host copy of the values and leaves every suffix (device, dtype,
grad_fn) to PyTorch.  tests/runtime/test_printing.py fails if it breaks.
"""

from __future__ import annotations

import torch
import torch._tensor_str as tensor_str

_original_str = tensor_str._str


def _str(self: torch.Tensor, *, tensor_contents: str | None = None) -> str:
    # plain tensors only: fake/functional/other subclasses (e.g. while
    # torch.compile traces) have no values to copy and print as PyTorch says
    if (
        type(self) in (torch.Tensor, torch.nn.Parameter)
        and self.device.type == "spyre"
        and tensor_contents is None
        and self.layout == torch.strided
    ):
        with torch.no_grad():
            host = self.detach().to("cpu")
        if host.numel() > 0:
            tensor_contents = tensor_str._tensor_str(host, len("tensor("))
    return _original_str(self, tensor_contents=tensor_contents)


def install() -> None:
    if tensor_str._str is not _str:
        tensor_str._str = _str
