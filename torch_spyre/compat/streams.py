"""IBM's device state and stream names on ``torch_spyre._C``."""

from __future__ import annotations

import enum
from typing import Any

import torch

from torch_spyre.compat.layouts import _contiguous_strides, empty_in_layout
from torch_spyre.layout import (
    SpyreTensorLayout,
)


class _Members(enum.IntEnum):
    """An int enum that prints as pybind11's do (``SpyreDeviceState.Ok``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class SpyreDeviceState(_Members):
    """IBM's device state (``_C.SpyreDeviceState``), read from the card."""

    Ok = 0
    NotInitialized = 1
    StreamError = 2


class SpyreStreamError(_Members):
    """IBM's stream error codes (``_C.SpyreStreamError``)."""

    Success = 0
    Shutdown = 1


class ElementArrangement(_Members):
    """IBM's element arrangements; we store every dtype STANDARD (our own
    formats: DL16, fp8 with scales, are chosen by the dtype, not the layout)."""

    STANDARD = 0
    DL16_TO_FP32 = 1
    QFP8CH = 2
    EXX2 = 3
    FP32_TO_DL16 = 4
    QFP8WT = 5


def get_device_state() -> SpyreDeviceState:
    """``StreamError`` while any card's stream is in error (a kernel failed on
    the card; ``torch.spyre.reset_device_state()`` clears it), else ``Ok``.
    Our cards start with the process, so never ``NotInitialized``."""
    from torch_spyre.runtime import cards

    if any(cards.stream_error(i) for i in range(cards.num_cards())):
        return SpyreDeviceState.StreamError
    return SpyreDeviceState.Ok


def stream_get_error(stream: Any) -> SpyreStreamError:
    """``Shutdown`` when the stream's card is in a stream error."""
    from torch_spyre.runtime import cards

    dev = stream.device() if callable(getattr(stream, "device", None)) else stream.device
    index = dev.index if isinstance(dev, torch.device) and dev.index is not None else 0
    return SpyreStreamError.Shutdown if cards.stream_error(index) else SpyreStreamError.Success


def stream_get_error_string(error: SpyreStreamError) -> str:
    return SpyreStreamError(int(error)).name


class _SpyreStreamBase:
    """IBM's stream handle (``id()``, ``device()``, ... as methods) over a torch.Stream."""

    def __init__(self, stream: torch.Stream) -> None:
        self._stream = stream

    def synchronize(self) -> None:
        self._stream.synchronize()

    def query(self) -> bool:
        return self._stream.query()

    def device(self) -> torch.device:
        return self._stream.device

    def id(self) -> int:
        return self._stream.stream_id

    def priority(self) -> int:
        return self._stream.priority

    def __repr__(self) -> str:
        return f"<torch_spyre._C._SpyreStreamBase id={self.id()} device={self.device()}>"


#: IBM's host-compute streams (for host work beside the card's): a pool per
#: card, handed out round-robin
HOST_COMPUTE_STREAMS = 4
_host_streams: dict[int, list[torch.Stream]] = {}
_host_next: dict[int, int] = {}


def _device_index(device: Any) -> int:
    from torch_spyre import _C

    device = torch.device(device) if device is not None else torch.device("spyre")
    return device.index if device.index is not None else _C._get_device()


def _host_pool(index: int) -> list[torch.Stream]:
    pool = _host_streams.get(index)
    if pool is None:
        dev = torch.device("spyre", index)
        pool = _host_streams[index] = [torch.Stream(dev) for _ in range(HOST_COMPUTE_STREAMS)]
    return pool


def host_compute_stream(device: Any = None) -> _SpyreStreamBase:
    index = _device_index(device)
    pool = _host_pool(index)
    i = _host_next.get(index, 0)
    _host_next[index] = (i + 1) % len(pool)
    return _SpyreStreamBase(pool[i])


def host_compute_stream_by_id(stream_id: int, device: Any = None) -> _SpyreStreamBase:
    for s in _host_pool(_device_index(device)):
        if s.stream_id == stream_id:
            return _SpyreStreamBase(s)
    raise ValueError(f"no host compute stream with id {stream_id}")


def _stream_fns() -> dict[str, Any]:
    def current_stream(device: Any = None) -> _SpyreStreamBase:
        return _SpyreStreamBase(torch.spyre.current_stream(device))

    def default_stream(device: Any = None) -> _SpyreStreamBase:
        return _SpyreStreamBase(torch.spyre.default_stream(device))

    def get_stream_from_pool(device: Any = None, priority: int = 0) -> _SpyreStreamBase:
        return _SpyreStreamBase(
            torch.Stream(torch.device("spyre", _device_index(device)), priority=priority)
        )

    def set_current_stream(stream: Any) -> None:
        torch.spyre.set_stream(getattr(stream, "_stream", stream))

    def synchronize(device: Any = None) -> None:
        torch.spyre.synchronize(device)

    def _get_default_generator(device: int = 0) -> torch.Generator:
        return torch.spyre.default_generators[int(device)]

    def get_spyre_tensor_layout(t: torch.Tensor) -> SpyreTensorLayout:
        return t.device_tensor_layout()

    def to_with_layout(t: torch.Tensor, layout: SpyreTensorLayout) -> torch.Tensor:
        return t.to(t.device if t.device.type == "spyre" else "spyre", device_layout=layout)

    def empty_with_layout(size, layout, dtype=None, device=None, pin_memory=None, fmt=None):
        if fmt not in (None, torch.contiguous_format, torch.preserve_format):
            raise RuntimeError(
                f"Spyre backend only supports contiguous memory format with a layout (got {fmt})"
            )
        return empty_in_layout(size, layout, dtype, device)

    def spyre_empty_with_layout(size, stride, dtype, layout) -> torch.Tensor:
        if [int(s) for s in stride] != _contiguous_strides(size):
            raise RuntimeError(
                f"spyre_empty_with_layout: strides {list(stride)} are not the contiguous "
                f"ones of size {list(size)}"
            )
        return empty_in_layout(size, layout, dtype, None)

    return {
        "get_spyre_tensor_layout": get_spyre_tensor_layout,
        "to_with_layout": to_with_layout,
        "empty_with_layout": empty_with_layout,
        "spyre_empty_with_layout": spyre_empty_with_layout,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "get_stream_from_pool": get_stream_from_pool,
        "set_current_stream": set_current_stream,
        "synchronize": synchronize,
        "_get_default_generator": _get_default_generator,
        "start_runtime": lambda: None,  # our cards start with the process
    }
