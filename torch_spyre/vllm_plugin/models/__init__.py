"""Model classes vLLM lacks (and spyre variants of a few of its own), registered
for the spyre platform."""

from __future__ import annotations

#: architecture (config.json "architectures") -> our class
MODELS = {
    "MPNetForMaskedLM": "torch_spyre.vllm_plugin.models.mpnet:MPNetEmbeddingModel",
    "MPNetModel": "torch_spyre.vllm_plugin.models.mpnet:MPNetEmbeddingModel",
}

#: vLLM's own classes replaced by a spyre variant (why: in each module); none
#: today (Granite 4's MoE input copy was one, until the compiler planned
#: Inductor's flat ``clone_preserve_strides`` copy)
OVERRIDES: dict[str, str] = {}


def register() -> None:
    """Through vLLM's public out-of-tree model hook (lazy: by import path)."""
    from vllm import ModelRegistry

    for arch, path in MODELS.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, path)
    for arch, path in OVERRIDES.items():
        ModelRegistry.register_model(arch, path)
