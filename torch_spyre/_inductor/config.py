"""IBM's compiler options over ours: see ``torch_spyre.compat.InductorConfig``."""

import sys

from torch_spyre.compat import InductorConfig

sys.modules[__name__].__class__ = InductorConfig
