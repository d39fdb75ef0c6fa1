"""torch_spyre's version (a module of its own: the compiler keys its caches by it)."""

__version__ = "0.1.0"
