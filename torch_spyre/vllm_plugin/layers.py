"""Spyre implementations of vLLM's layers (out-of-tree CustomOp / PluggableLayer).

Registered by the ``vllm.general_plugins`` entry point (``register``) so that
every process that builds a model instantiates these classes in place of vLLM's:

| vLLM class | mechanism | what runs on the card |
|---|---|---|
| RMSNorm | CustomOp.forward_oot | fp32 mean of squares, rsqrt, scale (+ fused residual add) |
| SiluAndMul | CustomOp.forward_oot | silu(gate) * up |
| RotaryEmbedding, DeepseekScalingRotaryEmbedding | CustomOp.forward_oot | cos/sin rows gathered by position; neox, GPT-J (interleaved) and partial rotations |
| Replicated/Column/MergedColumn/QKV/RowParallelLinear | PluggableLayer | one matmul (F.linear) |
| VocabParallelEmbedding, ParallelLMHead | PluggableLayer | embedding gather; the LM head matmul |
| LogitsProcessor | PluggableLayer | the head, then the one device->host copy of the logits |

By default the model runner compiles the whole model forward (these layers
included) with the spyre torch.compile backend, one graph per token bucket
(compile.py); with ``TORCH_SPYRE_VLLM_COMPILE=0`` they run as eager spyre kernels
(``torch_spyre/ops``). Either way the code below is the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp, PluggableLayer
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

SPYRE = torch.device("spyre")
HOST = torch.device("cpu")


def _on_card(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.device.type != "spyre":
        raise RuntimeError(
            f"spyre vLLM plugin: {what} is on {x.device}, expected spyre "
            "(the model runner moves weights and inputs to the card; was the "
            "model loaded by SpyreModelRunner?)"
        )
    return x


class SpyreRMSNorm(RMSNorm):
    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None:
            return self.forward_native(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = h.to(dtype)
        if self.has_weight:
            h = h * self.weight
        return h if residual is None else (h, residual)


class SpyreSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class SpyreRotary:
    """The card's rotary embedding, shared by vLLM's rotary classes whose
    forward is ``x * cos + rotate(x) * sin`` over a ``cos_sin_cache`` of
    [positions, rotary_dim] (cos half, then sin half)."""

    def _lane_shuffle_free(self) -> bool:
        """Neox style over the whole head: the rotation's lane shuffle is a
        ``cat`` of two half-heads, which the compiler turns into a
        signed-permutation matmul itself (compiler/passes.py)."""
        return self.is_neox_style and self.rotary_dim == self.head_size

    def spyre_prepare(self) -> None:
        """Register [max_pos, head_size] cos and sin tables as buffers, so that
        they move to the card with the weights and a compiled forward reads
        them as module buffers. Called by the runner.

        Neox over the whole head: each half repeated. Otherwise (GPT-J's
        interleaved pairs, DeepSeek; a partial rotary dim) the rotation is
        ``x * cos + (x @ P) * sin`` with P a [head_size, head_size] signed
        permutation (exact: one nonzero term per output), cos and sin laid out
        per lane, 1 and 0 on the lanes past the rotary dim: no strided lane
        access (``x[..., ::2]`` would split a stick into pairs, which neither
        the DMA engine nor the compiler does)."""
        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        if self._lane_shuffle_free():
            self.register_buffer("spyre_cos", torch.cat([cos, cos], dim=-1), persistent=False)
            self.register_buffer("spyre_sin", torch.cat([sin, sin], dim=-1), persistent=False)
            return
        hd, r = self.head_size, self.rotary_dim
        half = r // 2
        pos = cos.shape[0]
        full_cos = torch.ones(pos, hd, dtype=cos.dtype)
        full_sin = torch.zeros(pos, hd, dtype=sin.dtype)
        perm = torch.zeros(hd, hd, dtype=cos.dtype)
        i = torch.arange(half)
        if self.is_neox_style:
            lo, hi = i, i + half  # lanes (j, j + r/2) rotate together
            full_cos[:, :r], full_sin[:, :r] = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        else:
            lo, hi = 2 * i, 2 * i + 1  # lanes (2j, 2j + 1)
            full_cos[:, lo], full_cos[:, hi] = cos, cos
            full_sin[:, lo], full_sin[:, hi] = sin, sin
        # (x @ P)[lo] = -x[hi], (x @ P)[hi] = x[lo]
        perm[hi, lo], perm[lo, hi] = -1.0, 1.0
        self.register_buffer("spyre_cos", full_cos, persistent=False)
        self.register_buffer("spyre_sin", full_sin, persistent=False)
        self.register_buffer("spyre_perm", perm, persistent=False)

    def spyre_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if not hasattr(self, "spyre_cos"):
            self.spyre_prepare()
        tables = [self.spyre_cos, self.spyre_sin]
        if hasattr(self, "spyre_perm"):
            tables.append(self.spyre_perm)
        return tuple(t if t.dtype == dtype else t.to(dtype) for t in tables)

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if offsets is not None:
            positions = positions + offsets
        cos_table, sin_table, *perm = self.spyre_tables(query.dtype)
        # The tables (computed once on the host at load, moved with the weights)
        # gathered by position: two embedding lookups (DMA gathers, also inside a
        # compiled graph, one pair for all layers) instead of sin/cos on the card.
        pos = positions.flatten()
        cos = F.embedding(pos, cos_table)[:, None, :]
        sin = F.embedding(pos, sin_table)[:, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            x = x.view(x.shape[0], -1, self.head_size)
            if perm:
                return (x * cos + torch.matmul(x, perm[0]) * sin).reshape(shape)
            # slices, not chunk: the compiler turns a cat of (negated) slices
            # (rotate_half) into a signed-permutation matmul (compiler/passes.py)
            half = self.head_size // 2
            x1, x2 = x[..., :half], x[..., half:]
            return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).reshape(shape)

        return rotate(query), None if key is None else rotate(key)


class SpyreRotaryEmbedding(SpyreRotary, RotaryEmbedding):
    pass


class SpyreDeepseekScalingRotaryEmbedding(SpyreRotary, DeepseekScalingRotaryEmbedding):
    """DeepSeek's YaRN rotary (the real checkpoints' ``rope_scaling``): its own
    cos/sin cache (mscale folded in), the same rotation."""


class SpyreLinearMethod(UnquantizedLinearMethod):
    """Unquantized linear on the card: one matmul kernel (bias in its epilogue)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(_on_card(x, "a linear layer's input"), layer.weight, bias)


class SpyreEmbeddingMethod(UnquantizedEmbeddingMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = _on_card(x, "the LM head's input")
        head = layer.__dict__.get("spyre_compiled_head")  # set by the model runner
        if head is not None:
            return head(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_.to(layer.weight.device), layer.weight)


def _swap_quant_method(layer: torch.nn.Module, unquantized: type, spyre: type) -> None:
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return
    if type(qm) is unquantized:
        layer.quant_method = spyre()
        return
    if not _runs_on_spyre(layer, qm):
        raise NotImplementedError(
            f"{type(layer).__name__}: quantization method {type(qm).__name__} is not "
            "supported on spyre (unquantized fp32/fp16/bf16 weights, or fp8 weights: "
            "--quantization fp8 / fp8_per_tensor / fp8_per_channel, fp8 checkpoints and "
            "compressed-tensors fp8 checkpoints with per-tensor or per-channel scales)"
        )


def _runs_on_spyre(layer: torch.nn.Module, qm) -> bool:
    """A quantised linear method whose kernel is spyre's (quantization.py)."""
    from torch_spyre.vllm_plugin.quantization import SpyreFp8LinearKernel

    scheme = getattr(layer, "scheme", None)  # compressed-tensors keeps it on the layer
    kernels = (
        getattr(qm, "fp8_linear", None),
        getattr(scheme, "fp8_linear", None),
        getattr(scheme, "linear_kernel", None),
    )
    return any(isinstance(k, SpyreFp8LinearKernel) for k in kernels)


def _linear_class(base: type) -> type:
    def __init__(self, *args, **kwargs):  # noqa: N807 - a method for type()
        base.__init__(self, *args, **kwargs)
        _swap_quant_method(self, UnquantizedLinearMethod, SpyreLinearMethod)

    cls = type(f"Spyre{base.__name__}", (base,), {"__init__": __init__})
    # a module attribute, as a class statement makes it: pickle finds the class
    # by name (a saved trace holds the layers' classes: compiler/precompiled.py)
    globals()[cls.__name__] = cls
    return cls


class SpyreVocabParallelEmbedding(VocabParallelEmbedding):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_quant_method(self, UnquantizedEmbeddingMethod, SpyreEmbeddingMethod)


class SpyreParallelLMHead(ParallelLMHead):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_quant_method(self, UnquantizedEmbeddingMethod, SpyreEmbeddingMethod)


class SpyreLogitsProcessor(LogitsProcessor):
    """The LM head on the card; the logits come back to the host for the sampler."""

    def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
        # not super(): vLLM's LogitsProcessorWithLoRA calls this function on itself
        logits = LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
        return None if logits is None else logits.to(HOST)


CUSTOM_OPS: dict[str, type] = {
    "RMSNorm": SpyreRMSNorm,
    "SiluAndMul": SpyreSiluAndMul,
    "RotaryEmbedding": SpyreRotaryEmbedding,
    "DeepseekScalingRotaryEmbedding": SpyreDeepseekScalingRotaryEmbedding,
}


def _custom_ops() -> dict[str, type]:
    from torch_spyre.vllm_plugin.moe import SpyreFusedMoEMethod

    return {**CUSTOM_OPS, "UnquantizedFusedMoEMethod": SpyreFusedMoEMethod}


PLUGGABLE_LAYERS: dict[str, type] = {
    **{
        base.__name__: _linear_class(base)
        for base in (
            ReplicatedLinear,
            ColumnParallelLinear,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
    },
    "VocabParallelEmbedding": SpyreVocabParallelEmbedding,
    "ParallelLMHead": SpyreParallelLMHead,
    "LogitsProcessor": SpyreLogitsProcessor,
}


def register() -> None:
    """Register every class above with vLLM (idempotent: plugins load per process)."""
    from vllm.model_executor.custom_op import op_registry_oot

    for name, cls in _custom_ops().items():
        if op_registry_oot.get(name) is not cls:
            CustomOp.register_oot(cls, name=name)
    for name, cls in PLUGGABLE_LAYERS.items():
        if op_registry_oot.get(name) is not cls:
            PluggableLayer.register_oot(cls, name=name)
