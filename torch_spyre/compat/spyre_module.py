"""``torch.spyre``'s IBM names: the downcast-warning switches and ``torch.spyre.memory``."""

from __future__ import annotations

import types

import torch

_downcast_warning = True


def get_downcast_warning() -> bool:
    """IBM warns when int64 is narrowed to int32; this card stores int64
    exactly, so there is nothing to warn about.  The switch is kept."""
    return _downcast_warning


def set_downcast_warning(enabled: bool) -> None:
    global _downcast_warning
    _downcast_warning = bool(enabled)


def _memory_module() -> types.ModuleType:
    from torch_spyre.runtime import device_module as dm

    mod = types.ModuleType("torch.spyre.memory", "torch.spyre's memory API, IBM's module path.")

    def reset_accumulated_memory_stats(device=None) -> None:
        torch.accelerator.reset_accumulated_memory_stats(torch.device("spyre", dm._checked(device)))

    for fn in (
        dm.memory_allocated,
        dm.max_memory_allocated,
        dm.reset_peak_memory_stats,
        dm.memory_reserved,
        dm.max_memory_reserved,
        dm.memory_stats,
        dm.memory_summary,
        dm.mem_get_info,
        dm.empty_cache,
        reset_accumulated_memory_stats,
    ):
        setattr(mod, fn.__name__, fn)
    return mod
