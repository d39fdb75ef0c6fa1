"""IBM's public torch-spyre names, mapped onto our one implementation.

IBM's clients (spyre-inference, hf-adapters) are written against IBM's
torch-spyre: ``torch_spyre._C.SpyreTensorLayout`` with its three constructor
forms, ``DataFormats``, ``get_device_dtype``, ``device_layout=`` on
``Tensor.to`` and the factories, ``torch.spyre.memory``, the downcast-warning
switches, ``torch_spyre._inductor.{config, constants, decompositions}`` and
``torch_spyre.ops.fallbacks.FallbackWarning``.  This module is the only place
that knows those names; what is behind each is ours: one layout class
(``torch_spyre.layout.SpyreTensorLayout``), one allocator, one fallback, one
compiler.  Our own code never calls it.  What differs on purpose, and why:
docs/compat.md.

``install()`` (run by ``import torch_spyre``) puts the names in place.  Two
of them patch PyTorch, because no public extension point takes a new keyword
argument: ``Tensor.to`` and the factories accept ``device_layout=`` (PyTorch's
argument parser rejects unknown keywords before any dispatch or
``__torch_function__`` mode sees the call).  tests/runtime/test_compat.py
fails if either patch stops working.

One module per part of IBM's API: ``dtypes``, ``layouts``, ``device_layout``
(the two patches), ``spyre_module`` (``torch.spyre``), ``fallback``,
``inductor_config``, ``fp8_ops``, ``streams`` (device state and streams),
``model_utils`` (IBM's loader) and ``safetensors``.  This package re-exports
their names, as ``torch_spyre.compat`` did when it was one module.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from torch_spyre.compat import spyre_module as _spyre_module
from torch_spyre.compat.device_layout import (  # noqa: F401  (re-exported)
    _FACTORIES,
    _dtype_error_as_ibm,
    _dtype_named,
    _factory,
    _install_device_layout,
    _ones,
    _orig_factories,
    _orig_to,
    _patched,
    _signature,
    _sizes,
    _to,
)
from torch_spyre.compat.dtypes import (  # noqa: F401  (re-exported)
    DataFormats,
    _host_dtype,
    get_device_dtype,
    get_elem_in_stick,
)
from torch_spyre.compat.fallback import (  # noqa: F401  (re-exported)
    fallback_warning,
)
from torch_spyre.compat.fp8_ops import (  # noqa: F401  (re-exported)
    _IBM_FP8_OPS,
    _ibm_lib,
    _install_fp8_ops,
)
from torch_spyre.compat.inductor_config import (  # noqa: F401  (re-exported)
    CONSTANTS,
    InductorConfig,
    spyre_decompositions,
)
from torch_spyre.compat.layouts import (  # noqa: F401  (re-exported)
    _contiguous_strides,
    _dim_map_for,
    _fields_from_device,
    _from_dim_order,
    _infer_host,
    _logical_strides,
    _norm,
    _spyre_target,
    _stick_pads_a_one,
    _usage,
    empty_in_layout,
    fit,
    from_device,
    layout_fields,
    same_device_layout,
)
from torch_spyre.compat.model_utils import (  # noqa: F401  (re-exported)
    _apply_overridden,
    dma_dim_order_swapped,
    dma_indirect_access,
    load_model_to_spyre,
    patch_module_to_for_spyre,
)
from torch_spyre.compat.safetensors import (  # noqa: F401  (re-exported)
    _install_safetensors,
    _is_spyre,
    _SpyreSafeOpen,
    _SpyreSlice,
)
from torch_spyre.compat.spyre_module import (  # noqa: F401  (re-exported)
    _memory_module,
    get_downcast_warning,
    set_downcast_warning,
)
from torch_spyre.compat.streams import (  # noqa: F401  (re-exported)
    HOST_COMPUTE_STREAMS,
    ElementArrangement,
    SpyreDeviceState,
    SpyreStreamError,
    _device_index,
    _host_next,
    _host_pool,
    _host_streams,
    _Members,
    _SpyreStreamBase,
    _stream_fns,
    get_device_state,
    host_compute_stream,
    host_compute_stream_by_id,
    stream_get_error,
    stream_get_error_string,
)
from torch_spyre.layout import (  # noqa: F401  (re-exported)
    STICK_BYTES,
    SpyreTensorLayout,
    UnsupportedDtypeError,
    check_dtype,
    stick_elems,
)


def __getattr__(name: str) -> Any:
    # the switch lives in spyre_module (set_downcast_warning rebinds it there)
    if name == "_downcast_warning":
        return _spyre_module._downcast_warning
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install() -> None:
    """Put IBM's names in place (idempotent)."""
    from torch_spyre import _C
    from torch_spyre import layout as layout_mod

    layout_mod.FOREIGN.update(fields=layout_fields, device_dtype=get_device_dtype)

    for name, value in (
        ("SpyreTensorLayout", SpyreTensorLayout),
        ("DataFormats", DataFormats),
        ("get_device_dtype", get_device_dtype),
        ("get_elem_in_stick", get_elem_in_stick),
        ("get_downcast_warning", get_downcast_warning),
        ("set_downcast_warning", set_downcast_warning),
        ("SpyreDeviceState", SpyreDeviceState),
        ("SpyreStreamError", SpyreStreamError),
        ("ElementArrangement", ElementArrangement),
        ("get_device_state", get_device_state),
        ("stream_get_error", stream_get_error),
        ("stream_get_error_string", stream_get_error_string),
        ("_SpyreStreamBase", _SpyreStreamBase),
        ("host_compute_stream", host_compute_stream),
        ("host_compute_stream_by_id", host_compute_stream_by_id),
        *_stream_fns().items(),
    ):
        setattr(_C, name, value)
    spyre = torch.spyre
    memory = sys.modules.get("torch.spyre.memory") or _memory_module()
    sys.modules["torch.spyre.memory"] = memory
    for name, value in (
        ("SpyreTensorLayout", SpyreTensorLayout),
        ("DataFormats", DataFormats),
        ("get_device_dtype", get_device_dtype),
        ("get_elem_in_stick", get_elem_in_stick),
        ("get_downcast_warning", get_downcast_warning),
        ("set_downcast_warning", set_downcast_warning),
        ("memory", memory),
        ("reset_accumulated_memory_stats", memory.reset_accumulated_memory_stats),
        # IBM's allocator hooks, as torch.spyre._spyre_* (their tests call them)
        ("_spyre_get_allocator_stats", memory.memory_stats),
        ("_spyre_reset_accumulated_stats", memory.reset_accumulated_memory_stats),
        ("_spyre_reset_peak_stats", memory.reset_peak_memory_stats),
    ):
        setattr(spyre, name, value)
    _install_device_layout()
    torch.Tensor._spyre_tensor_patched = True  # IBM's marker of the patches above
    _install_fp8_ops()
    _install_safetensors()
    # IBM's runtime exports the number of visible cards; IBM's clients read it
    # (without importing torch_spyre) to decide whether a card is there.
    os.environ["AIU_WORLD_SIZE"] = str(spyre.device_count())
