"""torch-spyre: IBM's Spyre card as the PyTorch device ``spyre``.

``import torch_spyre`` (or just ``import torch`` once the package is installed,
through the ``torch.backends`` entry point) registers the device: PrivateUse1
renamed to ``spyre``, the ``torch.spyre`` module, device memory on the
simulated card, stick layouts, copies and eager ops.
"""

from __future__ import annotations

from torch_spyre._version import __version__  # noqa: E402, F401


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group: importing is registering.

    Defined before ``import torch``: when torch_spyre is imported first, torch's
    own import calls this entry point while torch_spyre is still initialising.
    """


import torch  # noqa: E402, F401

from torch_spyre.runtime import artifact_cache as _artifact_cache  # noqa: E402

# Inductor's and AOTAutograd's caches in TORCH_SPYRE_CACHE_DIR (unless the
# user placed them with TORCHINDUCTOR_CACHE_DIR): before anything compiles
_artifact_cache.adopt_torch_caches()

from torch_spyre.runtime import registration as _registration  # noqa: E402

_registration.register()

from torch_spyre import ops as _ops  # noqa: E402

_ops.register()

from torch_spyre.compiler import install as _install_compiler  # noqa: E402

_install_compiler()  # torch.compile on spyre tensors: registered once Inductor loads

from torch_spyre import compat as _compat  # noqa: E402

_compat.install()  # IBM's public names (docs/compat.md)

from torch_spyre import distributed as _distributed  # noqa: E402

_distributed.register()  # the spyreccl c10d backend (docs/distributed.md)

from torch_spyre.layout import SUPPORTED_DTYPES, SpyreTensorLayout  # noqa: E402
from torch_spyre.runtime.fallback import (  # noqa: E402
    fallback_counts,
    get_fallback_policy,
    reset_fallback_counts,
    set_fallback_policy,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "SpyreTensorLayout",
    "fallback_counts",
    "get_fallback_policy",
    "reset_fallback_counts",
    "set_fallback_policy",
]
