"""IBM's module path of the fallback warning: ``FallbackWarning`` is the category
of ours (``torch_spyre.runtime.fallback.SpyreFallbackWarning``, docs/compat.md)."""

from torch_spyre.runtime.fallback import SpyreFallbackWarning as FallbackWarning

__all__ = ["FallbackWarning"]
