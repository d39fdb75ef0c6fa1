"""Model classes vLLM lacks, registered for the spyre platform."""

from __future__ import annotations

#: architecture (config.json "architectures") -> our class
MODELS = {
    "MPNetForMaskedLM": "torch_spyre.vllm_plugin.models.mpnet:MPNetEmbeddingModel",
    "MPNetModel": "torch_spyre.vllm_plugin.models.mpnet:MPNetEmbeddingModel",
}


def register() -> None:
    """Through vLLM's public out-of-tree model hook (lazy: by import path)."""
    from vllm import ModelRegistry

    for arch, path in MODELS.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, path)
