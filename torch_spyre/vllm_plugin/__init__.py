"""vLLM platform plugin: serve models on the (simulated) Spyre card.

Two entry points (pyproject.toml) activate it once torch-spyre and vLLM are installed:

* ``vllm.platform_plugins``: :func:`register` names :class:`SpyrePlatform`
  (``platform.py``); vLLM asks every platform plugin at start-up and uses the one
  that answers.
* ``vllm.general_plugins``: :func:`register_ops` registers the out-of-tree layer
  implementations (``layers.py``) in every process that builds a model.

Set ``TORCH_SPYRE_VLLM=0`` to keep vLLM from activating the plugin (vLLM then falls
back to its own platform detection). Docs: docs/serving.md.
"""

from __future__ import annotations

import os

# The one vLLM release this plugin is written and tested against (the `vllm` extra
# pins it): vLLM's platform/worker/attention interfaces change between releases.
VLLM_VERSION = "0.32.0"

PLATFORM_QUALNAME = "torch_spyre.vllm_plugin.platform.SpyrePlatform"


def enabled() -> bool:
    return os.environ.get("TORCH_SPYRE_VLLM", "1") not in ("0", "false", "False", "")


def register() -> str | None:
    """``vllm.platform_plugins`` hook: the platform class to use, or None."""
    if not enabled():
        return None
    return PLATFORM_QUALNAME


def register_ops() -> None:
    """``vllm.general_plugins`` hook: register the spyre layers (idempotent)."""
    if not enabled():
        return
    from vllm.platforms import current_platform

    # Only when spyre is the platform: the layers assume spyre tensors.
    if getattr(current_platform, "device_name", None) != "spyre":
        return
    from torch_spyre.vllm_plugin import layers

    layers.register()
