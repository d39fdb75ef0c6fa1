"""IBM's model loader helpers (``torch_spyre.model_utils``)."""

from __future__ import annotations

import functools
import warnings

import torch

from torch_spyre.compat.dtypes import get_device_dtype
from torch_spyre.compat.layouts import _contiguous_strides
from torch_spyre.layout import (
    SpyreTensorLayout,
    check_dtype,
    stick_elems,
)


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
