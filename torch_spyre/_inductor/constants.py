"""IBM's compiler constants that mean something here (``torch_spyre.compat.CONSTANTS``)."""

from torch_spyre.compat import CONSTANTS

globals().update(CONSTANTS)
__all__ = sorted(CONSTANTS)
