"""IBM's ``FallbackWarning``: our fallback warning class."""

from __future__ import annotations


def fallback_warning() -> type[Warning]:
    from torch_spyre.runtime.fallback import SpyreFallbackWarning

    return SpyreFallbackWarning
