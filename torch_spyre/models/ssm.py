"""Mamba-2 layers of stock transformers models on the card (Granite 4, Bamba, ...).

A Mamba-2 mixer (``in_proj``, a causal depthwise ``conv1d``, ``A_log``,
``dt_bias``, ``D``, a gated RMSNorm, ``out_proj``) calls three module-level
functions of its modeling file for the state-space part: ``mamba2_chunk_scan``
(prefill: the chunked SSD form), ``mamba2_selective_state_update`` (decode:
the recurrent step) and the convolutions.  Without the ``mamba_ssm`` /
``causal_conv1d`` packages (CUDA only) transformers uses its PyTorch
reference versions: dozens of small ops per layer.

The ``mamba_kernels`` patch routes them to the card's programs:

* the convolutions need nothing: ``nn.Conv1d(groups=channels)`` is the
  depthwise conv1d kernel program (``ops/conv.py``);
* ``mamba2_chunk_scan`` -> ``spyre::ssd_chunk_scan`` (one grouped kernel:
  chunk states, state passing chunk after chunk, chunk outputs) and
  ``mamba2_selective_state_update`` -> ``spyre::ssm_step`` (one program,
  state updated in place in the model's cache).  transformers offers no
  registry for these functions (its ``use_kernel_func_from_hub_with_fallback``
  hook needs the ``kernels`` package and the Hub), so the patch **wraps the
  module-level functions** of the model's modeling file: spyre tensors go to
  the card's op, anything else (and any argument the op does not describe,
  e.g. packed sequences) to the original.  ``tests/models/test_mamba.py``
  fails if transformers stops calling them;
* ``*RMSNormGated`` modules with one group -> ``spyre::rmsnorm_gated`` (one
  row program), by module replacement.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

import torch_spyre.ops.ssm  # noqa: F401  (defines the spyre:: ops)

_WRAPPED = "_spyre_wrapped"


def _is_mamba2_mixer(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("A_log", "dt_bias", "D", "conv1d", "in_proj", "out_proj"))


def _needs_grad(*tensors) -> bool:
    """Training: the card's ops have no backward, the reference functions do."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def _chunk_scan(original):
    def mamba2_chunk_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        **kwargs,
    ):
        served = (
            hidden_states.device.type == "spyre"
            and not _needs_grad(hidden_states, dt, A, B, C, D)
            and dt_softplus
            and kwargs.get("z") is None
            and kwargs.get("cu_seqlens") is None
            and kwargs.get("seq_idx") is None
        )
        if not served:
            return original(
                hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                return_final_states=return_final_states, **kwargs,
            )  # fmt: skip
        h = hidden_states.shape[2]
        zeros = torch.zeros(h, dtype=torch.float32, device=hidden_states.device)
        y, final = torch.ops.spyre.ssd_chunk_scan(
            hidden_states,
            dt,
            A,
            B,
            C,
            zeros if D is None else D,
            zeros if dt_bias is None else dt_bias,
            initial_states,
            int(chunk_size),
            float(dt_limit[0]),
            float(dt_limit[1]),
        )
        return (y, final) if return_final_states else y

    setattr(mamba2_chunk_scan, _WRAPPED, original)
    return mamba2_chunk_scan


def _first(t: torch.Tensor, dims: int) -> torch.Tensor | None:
    """``t[..., 0, ..., 0]`` over its last ``dims`` dims when they are an expand
    (stride 0): the per-head value transformers broadcast; None otherwise."""
    if any(t.stride(-1 - i) != 0 for i in range(dims)):
        return None
    for _ in range(dims):
        t = t[..., 0]
    return t


def _state_update(original):
    def mamba2_selective_state_update(
        state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
    ):
        parts = None
        if (
            hidden_states.device.type == "spyre"
            and not _needs_grad(hidden_states, dt, A, B, C, D)
            and dt_softplus
            and z is None
            and D is not None
            and dt_bias is not None
        ):  # other keyword arguments are the layer's (the reference ignores them too)
            parts = (_first(dt, 1), _first(A, 2), _first(D, 1), _first(dt_bias, 1))
        if parts is None or any(p is None for p in parts):
            return original(
                state, hidden_states, dt, A, B, C, D=D, dt_bias=dt_bias,
                dt_softplus=dt_softplus, z=z, **kwargs,
            )  # fmt: skip
        dt1, a1, d1, bias1 = parts
        return torch.ops.spyre.ssm_step(state, hidden_states, dt1, a1, B, C, d1, bias1)

    setattr(mamba2_selective_state_update, _WRAPPED, original)
    return mamba2_selective_state_update


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x * silu(gate))`` over the whole row (one group) as one
    kernel program (``spyre::rmsnorm_gated``; without a gate, a plain RMSNorm);
    keeps the original's ``weight`` parameter."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = original.variance_epsilon
        self.group_size = self.weight.shape[0]

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
        eps = float(self.variance_epsilon)
        if gate is not None and not _needs_grad(hidden_states, gate, self.weight):
            return torch.ops.spyre.rmsnorm_gated(hidden_states, gate, self.weight, eps)
        dtype = hidden_states.dtype
        x = hidden_states.float()
        if gate is not None:
            x = x * torch.nn.functional.silu(gate.float())
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * x.to(dtype)


def mamba_kernels(model: nn.Module, options: Any) -> str | None:
    """Route Mamba-2 mixers' scans and gated norms to the card's programs (see above)."""
    mixers = [m for m in model.modules() if _is_mamba2_mixer(m)]
    if not mixers:
        return None
    wrapped = set()
    for mixer in mixers:
        mod = sys.modules.get(type(mixer).__module__)
        for name, wrap in (
            ("mamba2_chunk_scan", _chunk_scan),
            ("mamba2_selective_state_update", _state_update),
        ):
            fn = getattr(mod, name, None)
            if fn is None or hasattr(fn, _WRAPPED):
                if fn is not None:
                    wrapped.add(name)
                continue
            # monkey patch of a module-level function (no public hook; see the docstring)
            setattr(mod, name, wrap(fn))
            wrapped.add(name)
    norms = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNormGated") and not isinstance(
                child, GatedRMSNorm
            ):
                if getattr(child, "group_size", child.weight.shape[0]) == child.weight.shape[0]:
                    setattr(parent, name, GatedRMSNorm(child))
                    norms += 1
    return (
        f"mamba2: {len(mixers)} mixers, {' and '.join(sorted(wrapped)) or 'no scan'} on the card, "
        f"{norms} gated norms as one program"
    )
