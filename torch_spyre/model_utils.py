"""IBM's ``torch_spyre.model_utils``: see ``torch_spyre.compat`` (model loading)."""

from torch_spyre.compat import dma_dim_order_swapped as _dma_to_spyre_dim_order_swapped
from torch_spyre.compat import dma_indirect_access as _dma_to_spyre_indirect_access
from torch_spyre.compat import load_model_to_spyre, patch_module_to_for_spyre

__all__ = [
    "_dma_to_spyre_dim_order_swapped",
    "_dma_to_spyre_indirect_access",
    "load_model_to_spyre",
    "patch_module_to_for_spyre",
]
