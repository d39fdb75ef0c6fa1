"""Stock transformers models on the spyre card: adapters applied at load time.

    model = torch_spyre.models.load("smollm2")           # offline name, HF folder or path
    model = torch_spyre.models.prepare(any_hf_model)     # patch + move to spyre

An adapter is a small declarative list of patches (``torch_spyre.models.patches``,
``torch_spyre.models.moe``), each of which finds the modules it changes; the
registry names the architectures validated against the CPU.  An architecture
not in it gets the same patches (by what it contains) and says so once.

``compile=True`` wraps the forward in plain ``torch.compile`` (the spyre
Inductor backend is reached through the device); it is **off by default** and
not yet validated: the compiler is still being built (torch_spyre/compiler).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import transformers
from torch import nn

from torch_spyre.models import layer_regions, offline, quantized
from torch_spyre.models.attention import attention_variants
from torch_spyre.models.moe import moe_experts
from torch_spyre.models.patches import Patch, chunk_lm_head, sdpa_attention, tabulate_rotary
from torch_spyre.models.ssm import mamba_kernels

Kind = Literal["embedding", "causal-lm"]


@dataclass(frozen=True)
class Adapter:
    """What a model family needs on the card: a list of patches, each saying why."""

    name: str
    config_class: type
    patches: tuple[Patch, ...] = ()
    notes: str = ""


@dataclass
class PrepareOptions:
    device: str | torch.device = "spyre"
    #: None keeps the model's dtype (fp32 for the validation reference)
    dtype: torch.dtype | None = None
    #: experimental: torch.compile the forward (off until the compiler lands)
    compile: bool = False
    #: length of the host-precomputed rotary tables (capped by max_position_embeddings)
    max_positions: int = 4096
    #: largest output projection run as one kernel (None: half a core's address span)
    max_linear_bytes: int | None = None
    applied: list[str] = field(default_factory=list)


#: every patch finds the modules it changes (rotary embeddings, attention, experts,
#: an output projection) and does nothing when the model has none: an adapter is
#: what the model *contains*, so a config class nobody registered gets them too
PATCHES: tuple[Patch, ...] = (
    sdpa_attention,
    attention_variants,
    tabulate_rotary,
    moe_experts,
    mamba_kernels,
    chunk_lm_head,
)
_NOTES = (
    "rotary cos/sin tabulated on the host once (no trig on the card); attention through SDPA "
    "(soft-capped or sink attention through the 'spyre' attention function); "
    "mixture-of-experts layers as one grouped kernel program; Mamba-2 scans and gated norms as "
    "kernel programs; an lm_head too large for one "
    "matmul kernel split over the vocabulary (each only where the model has the module)"
)

#: the architectures validated against the CPU (tests/models/test_matrix.py), by
#: transformers config class; lookup walks the config's MRO
REGISTRY: dict[type, Adapter] = {}


def register(adapter: Adapter) -> Adapter:
    REGISTRY[adapter.config_class] = adapter
    return adapter


VALIDATED: dict[str, str] = {
    # decoders
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "granite": "GraniteConfig",
    "granitemoe": "GraniteMoeConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "gemma4_text": "Gemma4TextConfig",
    "phi3": "Phi3Config",
    "olmo2": "Olmo2Config",
    "gpt2": "GPT2Config",
    "gpt_neox": "GPTNeoXConfig",
    "falcon": "FalconConfig",
    "starcoder2": "Starcoder2Config",
    "deepseek_v3": "DeepseekV3Config",
    # encoders (t5: encoder-decoder)
    "bert": "BertConfig",
    "roberta": "RobertaConfig",
    "xlm-roberta": "XLMRobertaConfig",
    "mpnet": "MPNetConfig",
    "t5": "T5Config",
}

for _name, _cls in VALIDATED.items():
    register(Adapter(_name, getattr(transformers, _cls), PATCHES, _NOTES))

_warned: set[str] = set()


def adapter_for(config: transformers.PretrainedConfig) -> Adapter | None:
    """The registered adapter of ``config``'s class (None: not validated)."""
    for cls in type(config).__mro__:
        if cls in REGISTRY:
            return REGISTRY[cls]
    return None


def prepare(
    model: nn.Module,
    *,
    device: str | torch.device = "spyre",
    dtype: torch.dtype | None = None,
    compile: bool = False,
    max_positions: int = 4096,
    max_linear_bytes: int | None = None,
) -> nn.Module:
    """Apply the model's adapter, then move it to ``device`` (in eval mode).

    The descriptions of the patches applied are left in ``model.spyre_patches``.
    """
    import torch_spyre  # noqa: F401  (registers the device)

    opts = PrepareOptions(device, dtype, compile, max_positions, max_linear_bytes)
    # a compressed-tensors checkpoint keeps its 8-bit weights (models/quantized.py)
    n_quantized = quantized.from_compressed_tensors(model)
    if n_quantized:
        opts.applied.append(f"compressed-tensors: {n_quantized} linear layers kept 8-bit")
    cfg = model.config
    adapter = adapter_for(cfg)
    if adapter is None:
        arch = type(cfg).__name__
        if arch not in _warned:
            _warned.add(arch)
            warnings.warn(
                f"torch_spyre.models: no adapter for {arch} (not validated on the card); "
                "applying the patches its modules need (check torch_spyre.fallback_counts() "
                "for host fallbacks)",
                stacklevel=2,
            )
        adapter = Adapter(arch, type(cfg), PATCHES, "found by content")
    # patches build host-side tables: apply them before the move
    for patch in adapter.patches:
        what = patch(model, opts)
        if what:
            opts.applied.append(f"{patch.__name__}: {what}")
    model.eval()
    if dtype is not None:
        model.to(dtype)
    model.to(device)  # keeps tied weights tied (one device copy)
    if compile:
        # the decoder layers traced once (models/layer_regions.py)
        what = layer_regions.mark_layers(model)
        if what:
            opts.applied.append(f"layer_regions: {what}")
    model.spyre_patches = list(opts.applied)
    model.spyre_compiled = compile
    if compile:
        from torch_spyre.compiler import regions
        from torch_spyre.compiler.precompiled import PrecompiledForward

        # one graph per input shape (models.generate keeps one shape per
        # bucket), saved whole in the artifact cache: a later process loads it
        # without tracing (compiler/precompiled.py)
        model.forward = PrecompiledForward(
            model, regions.flat_inductor, retry=functools.partial(layer_regions.undo_on, model)
        )
    return model


def resolve(name_or_path: str | Path) -> tuple[str, Kind | None]:
    """(folder for from_pretrained, kind or None when unknown) of a name or path."""
    known = offline.lookup(str(name_or_path))
    if known is not None:
        return str(offline.folder(known.name)), known.kind
    return str(name_or_path), None


def kind_of(config: transformers.PretrainedConfig) -> Kind:
    archs = getattr(config, "architectures", None) or []
    return "causal-lm" if any("CausalLM" in a for a in archs) else "embedding"


def load(
    name_or_path: str | Path,
    *,
    device: str | torch.device = "spyre",
    dtype: torch.dtype | None = None,
    compile: bool = False,
    kind: Kind | None = None,
    **prepare_kwargs,
) -> nn.Module:
    """Load a model (offline name, local folder) on the host, adapt it, move it to ``device``.

    ``kind``: "causal-lm" loads ``AutoModelForCausalLM``, "embedding" ``AutoModel``;
    by default it is taken from the offline table or the config's architectures.
    """
    return prepare(
        load_reference(name_or_path, kind=kind),
        device=device,
        dtype=dtype,
        compile=compile,
        **prepare_kwargs,
    )


def load_reference(name_or_path: str | Path, *, kind: Kind | None = None) -> nn.Module:
    """The stock model on the CPU in fp32 (the validation reference), unpatched."""
    folder, known_kind = resolve(name_or_path)
    kind = kind or known_kind
    if kind is None:
        kind = kind_of(transformers.AutoConfig.from_pretrained(folder))
    auto = transformers.AutoModelForCausalLM if kind == "causal-lm" else transformers.AutoModel
    return auto.from_pretrained(folder, dtype=torch.float32).eval()


def load_tokenizer(name_or_path: str | Path):
    folder, _ = resolve(name_or_path)
    return transformers.AutoTokenizer.from_pretrained(folder)


__all__ = [
    "PATCHES",
    "REGISTRY",
    "VALIDATED",
    "Adapter",
    "PrepareOptions",
    "adapter_for",
    "kind_of",
    "load",
    "load_reference",
    "load_tokenizer",
    "offline",
    "prepare",
    "register",
    "resolve",
]
