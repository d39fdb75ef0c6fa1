"""``safetensors.safe_open`` on a spyre device (read on the CPU, moved to the card)."""

from __future__ import annotations

import sys
from typing import Any

import torch


# safetensors' Rust side parses the device string itself and accepts only
# cpu, cuda, mps, npu, xpu, xla, mlu, musa, hpu and anon ints: neither "spyre"
# nor "privateuseone" (0.8.0: "device spyre is invalid"), and it offers no hook
# to register a backend.  So ``safe_open`` (the one function ``load_file`` and
# Hugging Face loaders call) is wrapped: a spyre device opens the file on the
# CPU and moves each tensor to the card as it is read.  Other devices go to
# safetensors unchanged.  tests/compat/test_safetensors.py fails if this stops
# working.
def _is_spyre(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "spyre"
    return isinstance(device, str) and device.split(":")[0] == "spyre"


class _SpyreSlice:
    def __init__(self, inner: Any, device: torch.device):
        self._inner, self._device = inner, device

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._inner[index].to(self._device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SpyreSafeOpen:
    """``safe_open(path, framework="pt", device="spyre")``: read on the CPU,
    tensors handed out on the card."""

    def __init__(self, inner: Any, device: torch.device):
        self._inner, self._device = inner, device

    def __enter__(self) -> _SpyreSafeOpen:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._inner.get_tensor(name).to(self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:  # load_file's call
        return {k: self.get_tensor(k) for k in self._inner.keys()}

    def get_slice(self, name: str) -> _SpyreSlice:
        return _SpyreSlice(self._inner.get_slice(name), self._device)

    def __getattr__(self, name: str) -> Any:  # keys, metadata, offset_keys, ...
        return getattr(self._inner, name)


def _install_safetensors() -> None:
    # Only the top-level package (the Rust binding; it imports no torch):
    # safetensors.torch imports torch, whose backend autoload runs this, before
    # its own ``from safetensors import safe_open``, which then takes the wrapper.
    try:
        import safetensors
    except ImportError:
        return
    original = safetensors.safe_open
    if getattr(original, "_spyre_wrapped", False):
        return

    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        if _is_spyre(device):
            dev = torch.device(device)
            inner = original(filename, framework=framework, device="cpu", **kwargs)
            return _SpyreSafeOpen(inner, dev)
        return original(filename, framework=framework, device=device, **kwargs)

    safe_open._spyre_wrapped = True  # type: ignore[attr-defined]
    safe_open.__doc__ = original.__doc__
    safetensors.safe_open = safe_open
    st_torch = sys.modules.get("safetensors.torch")
    if st_torch is not None and hasattr(st_torch, "safe_open"):  # imported before us
        st_torch.safe_open = safe_open
