"""Dynamo's device interface and Inductor's device op overrides for spyre.

Properties come from the card's hardware config (``torch.spyre.get_device_properties``):
cores, LX, bandwidths, clock, peak fp16 FLOP/s.  Kernels run to completion at
launch on the simulated card, so synchronisation is a no-op and there is one
stream per card.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import DeviceInterface


def _mod():
    return torch.spyre  # type: ignore[attr-defined]


class SpyreInterface(DeviceInterface):
    class device:  # noqa: N801 - the torch.cuda spelling
        def __new__(cls, device):
            return _mod().device(device)

    class Event:  # noqa: D106
        def __new__(cls, *args, **kwargs):
            return _mod().Event(*args, **kwargs)

    class Stream:  # noqa: D106
        def __new__(cls, *args, **kwargs):
            return _mod().Stream(*args, **kwargs)

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            _mod().set_device(device)

        @staticmethod
        def current_device() -> int:
            return _mod().current_device()

        @staticmethod
        def get_device_properties(device=None) -> Any:
            return _mod().get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return _mod().current_device()

    @staticmethod
    def set_device(device) -> None:
        _mod().set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        prev = _mod().current_device()
        if device != prev:
            _mod().set_device(device)
        return prev

    @staticmethod
    def exchange_device(device: int) -> int:
        return SpyreInterface.maybe_exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return _mod().device_count()

    @staticmethod
    def is_available() -> bool:
        return _mod().is_available()

    @staticmethod
    def stream(stream):
        return _mod().stream(stream)

    @staticmethod
    def current_stream():
        return _mod().current_stream()

    @staticmethod
    def set_stream(stream) -> None:
        _mod().set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        pass

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        _mod().synchronize(device)

    @classmethod
    def get_device_properties(cls, device=None) -> Any:
        return _mod().get_device_properties(device)

    @staticmethod
    def get_compute_capability(device=None) -> Any:
        p = _mod().get_device_properties(device)
        return f"spyre-{p.cores}c"

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def is_dtype_supported(dtype: torch.dtype, including_emulation: bool = False) -> bool:
        from torch_spyre.layout import SUPPORTED_DTYPES

        return dtype in SUPPORTED_DTYPES

    @staticmethod
    def memory_allocated(device=None) -> int:
        return _mod().memory_allocated(device)

    @staticmethod
    def is_triton_capable(device=None) -> bool:
        return False
