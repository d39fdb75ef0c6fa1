"""vLLM's fused MoE on the card.

vLLM picks the unquantized MoE backend ``OOT`` for an out-of-tree platform
and leaves the kernel to the platform (``UnquantizedFusedMoEMethod`` is a
``CustomOp``: its public out-of-tree hook is
``CustomOp.register_oot``).  ``SpyreFusedMoEMethod`` computes the routed
experts as the device op ``spyre::moe_experts`` (``torch_spyre/ops/moe.py``:
integer grouping by expert, one grouped SwiGLU kernel program, the weighted
combine), the same op the transformers adapter uses.  vLLM's router (softmax
or sigmoid, top-k, renormalisation) runs before it, on the card.

vLLM's ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight``
[E, H, I] are the op's ``gate_up_proj`` / ``down_proj`` as loaded: no
re-layout.  Shared experts (DeepSeek's) run as their own MLP, called where
vLLM's modular kernels call them.  What the op does not describe (expert
biases, expert parallelism, the router weight applied to the input,
activations other than SiLU/GELU with a gate) is refused with an error naming it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

import torch_spyre.ops.moe  # noqa: F401  (registers spyre::moe_experts)

#: vLLM activation -> the op's activation (all gated: act(gate) * up)
_ACTS = {"silu": "silu", "gelu": "gelu"}


class SpyreFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Unquantized routed experts as one ``spyre::moe_experts`` call."""

    @property
    def is_monolithic(self) -> bool:
        # routing first (vLLM's router), then ``apply`` with the top-k
        return False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # no kernel to build and no re-layout: the op reads vLLM's weights
        _check(layer, self.moe)

    def forward_oot(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if shared_experts is not None:
            # as vLLM's modular kernels do: the shared experts run here when their
            # order is "inside the kernel" (it keeps their output for the runner),
            # and do nothing when the runner runs them itself
            from vllm.model_executor.layers.fused_moe.runner.shared_experts import (
                SharedExpertsOrder,
            )

            inp = shared_experts_input if shared_experts_input is not None else x
            shared_experts(inp, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        act = _ACTS[_act_name(layer)]
        return torch.ops.spyre.moe_experts(
            x,
            topk_ids.to(torch.int64),
            topk_weights.to(x.dtype),
            layer.w13_weight,
            layer.w2_weight,
            act,
        )


def _act_name(layer: torch.nn.Module) -> str:
    act = getattr(layer, "activation", "silu")
    return str(getattr(act, "value", act))


def _check(layer: torch.nn.Module, moe) -> None:
    """Refuse, when loading, what ``spyre::moe_experts`` does not compute."""
    problems = []
    if getattr(moe, "has_bias", False):
        problems.append("expert biases")
    if not getattr(moe, "is_act_and_mul", True) or _act_name(layer) not in _ACTS:
        problems.append(f"activation {_act_name(layer)!r} (served: gated silu / gelu)")
    if getattr(layer, "expert_map", None) is not None:
        problems.append("expert parallelism (an expert map)")
    if getattr(layer, "apply_router_weight_on_input", False):
        problems.append("the router weight applied to the input")
    if problems:
        raise NotImplementedError(
            f"spyre fused MoE ({type(layer).__name__}): {', '.join(problems)} not supported "
            "on the card; serve a model with SwiGLU experts without biases, or run it on "
            "the CPU platform"
        )
