"""Mixture-of-experts layers of stock transformers models on the card.

transformers 5 stores the experts of Mixtral, Qwen3-MoE, GraniteMoe(Hybrid),
DeepSeek-V3, ... as stacked tensors in a class decorated with
``@use_experts_implementation`` and picks their forward through a public
registry, ``ExpertsInterface`` (``config._experts_implementation``:
``"eager"`` is a Python loop over the experts, ``"grouped_mm"`` sorts the
routed tokens and calls ``torch._grouped_mm``).  We register one more
implementation, ``"spyre"``: the whole experts layer as the device op
``spyre::moe_experts`` (grouping, one grouped SwiGLU kernel program, the
weighted combine: ``torch_spyre/ops/moe.py``), and the ``moe_experts`` patch
selects it with ``model.set_experts_implementation("spyre")``.

Experts the op does not describe (biases, transposed or interleaved
weights, a post-expert norm, an activation without a vector op) keep the
stock ``grouped_mm`` path, which also runs on the card
(``torch._grouped_mm`` is a grouped kernel program, ``histc``/``sort`` are
adapters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "spyre"

#: activation module class name -> the op's activation name
_ACTS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "ReLU": "relu",
}


def _activation(experts: nn.Module) -> str | None:
    act = getattr(experts, "act_fn", None)
    name = _ACTS.get(type(act).__name__)
    if name == "gelu" and getattr(act, "approximate", "none") not in ("none", None):
        return None
    return name


def served(experts: nn.Module) -> bool:
    """True when ``spyre::moe_experts`` computes exactly this experts module."""
    return (
        getattr(experts, "has_gate", False)
        and not getattr(experts, "has_bias", True)
        and not getattr(experts, "is_transposed", True)
        and getattr(experts, "is_concatenated", False)
        and not getattr(experts, "has_post_expert_norm", True)
        and not getattr(experts, "_is_expert_parallel", True)
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
        and type(experts)._apply_gate.__name__ == "_default_apply_gate"
        and _activation(experts) is not None
    )


def spyre_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"spyre"`` experts implementation (see the module docstring)."""
    training = torch.is_grad_enabled() and (
        hidden_states.requires_grad or self.gate_up_proj.requires_grad
    )
    if training or not served(self):  # the op has no backward: the stock path trains
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    out = torch.ops.spyre.moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        _activation(self),
    )
    return out.to(hidden_states.dtype)


def _grouped_mm_fallback_spyre(input, weight, offs):
    """``transformers::grouped_mm_fallback`` on the card: the grouped matmul
    program (``torch._grouped_mm``'s device kernel), not its per-expert loop."""
    return torch._grouped_mm(input.to(weight.dtype), weight, offs=offs)


_fallback_registered = False


def register() -> None:
    """Add ``"spyre"`` to transformers' experts registry (once; public API).

    Experts the device op does not describe run transformers' ``grouped_mm``
    path; compiled with a non-bf16 dtype, it calls its custom op
    ``transformers::grouped_mm_fallback`` (a Python loop over the experts with
    a host read of the offsets).  Its spyre kernel registered here is the one
    grouped matmul program per call instead."""
    global _fallback_registered
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    import torch_spyre.ops.moe  # noqa: F401  (defines spyre::moe_experts)

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, spyre_experts_forward)
    if not _fallback_registered and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        torch.library.register_kernel(
            "transformers::grouped_mm_fallback", "spyre", _grouped_mm_fallback_spyre
        )
        _fallback_registered = True


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward transformers dispatches through ``ExpertsInterface``."""
    # the attributes use_experts_implementation's __init__ sets
    marks = ("has_gate", "has_bias", "is_concatenated", "_is_expert_parallel")
    return [m for m in model.modules() if all(hasattr(m, a) for a in marks)]


def moe_experts(model: nn.Module, options: Any) -> str | None:
    """Run every mixture-of-experts layer as one grouped kernel (see above)."""
    experts = experts_modules(model)
    if not experts or not hasattr(model, "set_experts_implementation"):
        return None
    register()
    model.set_experts_implementation(NAME)
    fused = sum(served(m) for m in experts)
    kinds = sorted({type(m).__name__ for m in experts})
    note = "" if fused == len(experts) else f" ({len(experts) - fused} keep grouped_mm)"
    return f"experts: {len(experts)} {'/'.join(kinds)} as one grouped program each{note}"
