"""Granite 4 (granitemoehybrid) with the MoE's input copy the compiler can run.

vLLM's decoder layers run ``moe(h.clone()) + shared_mlp(h)``: ``moe_forward``
is declared to mutate its input, so the clone keeps ``h`` for the shared MLP.
In a compiled forward Inductor drops the clone as a no-op, then (``h`` being
read after the op: its pattern passes move the shared MLP after the MoE)
copies ``h`` again as ``clone_preserve_strides``: a copy through a flat 1-D
view of the [tokens, hidden] buffer feeding an opaque op, which the spyre
compiler cannot plan as a kernel program ("load of bufN: index x0 reads past
dim 1 of the buffer"; reproduced by ``tests/vllm/test_vllm_models.py::
test_mutated_input_clone_compiles``).  Here the copy is ``spyre_vllm::copy``,
an opaque op (the card's copy kernel, outside the kernel programs) that
Inductor keeps: the MoE then mutates a buffer nobody else reads, no second
copy.  Registered over vLLM's class through ``ModelRegistry``
(models/__init__.py); the layers are vLLM's, their class swapped for a
subclass whose only change is ``forward``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models import granitemoehybrid as g


@torch.library.custom_op("spyre_vllm::copy", mutates_args=())
def copy(x: torch.Tensor) -> torch.Tensor:
    """``x.clone()`` as an opaque op (see the module docstring)."""
    return x.clone()


@copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _ffn(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """vLLM's MoE block: ``moe(copy of h) + shared_mlp(h)``."""
    moe, shared = layer.block_sparse_moe, layer.shared_mlp
    if shared is None:
        return h if moe is None else moe(h)
    if moe is None:
        return shared(h)
    return moe(torch.ops.spyre_vllm.copy(h)) + shared(h)


class SpyreMambaDecoderLayer(g.GraniteMoeHybridMambaDecoderLayer):
    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, **kwargs):
        residual = hidden_states
        output = self.mamba(self.input_layernorm(hidden_states))
        hidden_states = residual + output * self.residual_multiplier
        residual = hidden_states
        hidden_states = _ffn(self, self.post_attention_layernorm(hidden_states))
        return residual + hidden_states * self.residual_multiplier, residual


class SpyreAttentionDecoderLayer(g.GraniteMoeHybridAttentionDecoderLayer):
    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(
            positions=positions, hidden_states=self.input_layernorm(hidden_states)
        )
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        hidden_states = _ffn(self, self.post_attention_layernorm(hidden_states))
        return residual + hidden_states * self.residual_multiplier, residual


_SPYRE_LAYERS = {
    g.GraniteMoeHybridMambaDecoderLayer: SpyreMambaDecoderLayer,
    g.GraniteMoeHybridAttentionDecoderLayer: SpyreAttentionDecoderLayer,
}


class SpyreGraniteMoeHybridForCausalLM(g.GraniteMoeHybridForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        for layer in self.model.layers:
            spyre_cls = _SPYRE_LAYERS.get(type(layer))
            if spyre_cls is not None:
                layer.__class__ = spyre_cls  # same module and weights, our forward
