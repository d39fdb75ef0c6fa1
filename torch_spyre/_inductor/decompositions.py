"""IBM's decomposition table: what our backend adds to Inductor's (``torch_spyre.compat``)."""

from torch_spyre.compat import spyre_decompositions

__all__ = ["spyre_decompositions"]
