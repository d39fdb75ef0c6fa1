"""vLLM platform plugin: serve models on the (simulated) Spyre card.

Two entry points (pyproject.toml) activate it once torch-spyre and vLLM are installed:

* ``vllm.platform_plugins``: :func:`register` names :class:`SpyrePlatform`
  (``platform.py``); vLLM asks every platform plugin at start-up and uses the one
  that answers.
* ``vllm.general_plugins``: :func:`register_ops` registers the out-of-tree layer
  implementations (``layers.py``) in every process that builds a model.

Set ``TORCH_SPYRE_VLLM=0`` to keep vLLM from activating the plugin (vLLM then falls
back to its own platform detection). When IBM's spyre-inference plugin is installed
and selected, ours stands down (:func:`register` returns None); ``VLLM_PLUGINS``
picks either. Docs: docs/serving.md, docs/compat.md.
"""

from __future__ import annotations

import os

# The one vLLM release this plugin is written and tested against (the `vllm` extra
# pins it): vLLM's platform/worker/attention interfaces change between releases.
VLLM_VERSION = "0.32.0"

PLATFORM_QUALNAME = "torch_spyre.vllm_plugin.platform.SpyrePlatform"

#: vLLM's start method for its engine and worker processes, as the user set it
#: when vLLM first asked for a platform (None: not set).  ``vllm serve`` sets
#: ``spawn`` after that, for every platform (``cli_env_setup``); the spyre
#: platform tells the two apart (``platform.start_method``).
MP_METHOD_AT_START: str | None = None
_asked = False


def enabled() -> bool:
    """The ``vllm`` setting (``TORCH_SPYRE_VLLM``)."""
    from torch_spyre import settings

    return settings.get().vllm


#: IBM's vLLM platform plugin on torch-spyre (spyre-inference) and its entry point
IBM_PLUGIN = "spyre_inference"


def ibm_plugin_selected() -> bool:
    """Whether IBM's spyre-inference platform plugin is installed and vLLM will load it.

    vLLM refuses to start when two platform plugins answer, so ours stands down
    for IBM's: ``VLLM_PLUGINS`` (vLLM's own list of plugins to load) picks either.
    """
    from importlib.metadata import entry_points

    if not any(ep.name == IBM_PLUGIN for ep in entry_points(group="vllm.platform_plugins")):
        return False
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is None or IBM_PLUGIN in [p.strip() for p in allowed.split(",")]


def register() -> str | None:
    """``vllm.platform_plugins`` hook: the platform class to use, or None."""
    global MP_METHOD_AT_START, _asked
    if not _asked:
        _asked = True
        MP_METHOD_AT_START = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if not enabled():
        return None
    if ibm_plugin_selected():
        import logging

        logging.getLogger("vllm.torch_spyre").info(
            "torch_spyre's vLLM platform stands down: IBM's %s plugin is installed and "
            "selected (VLLM_PLUGINS=spyre picks torch_spyre's instead)",
            IBM_PLUGIN,
        )
        return None
    # DeepSeek-V2/V3 latent attention (MLA) is served from the latent cache
    # (vllm_plugin/mla.py); vLLM's own VLLM_MLA_DISABLE=1 picks the expanded
    # multi-head form over the paged cache instead (attention.py).
    return PLATFORM_QUALNAME


def register_ops() -> None:
    """``vllm.general_plugins`` hook: register the spyre layers (idempotent)."""
    if not enabled():
        return
    from vllm.platforms import current_platform

    # Only when spyre is the platform: the layers assume spyre tensors.
    if getattr(current_platform, "device_name", None) != "spyre":
        return
    from torch_spyre.vllm_plugin import layers, mamba, metrics, models, quantization

    layers.register()
    mamba.register()  # Mamba-2 mixer, gated norm and backend of hybrid models
    quantization.register()  # fp8 linear layers on the card
    models.register()
    metrics.install_api_server_collector()
