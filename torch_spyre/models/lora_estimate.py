"""``spyre estimate --lora N,rank``: a decode step with adapters on every projection, modelled.

Every linear projection of a decoder layer (attention and MLP; vLLM's LoRA
layers wrap the same ones) adds its LoRA deltas to its output through the op
a served step runs, ``spyre::punica_sgmv`` (``ops/lora.py``: one grouped
shrink/expand launch per projection over the step's tokens), here ``batch``
decode tokens spread over ``N`` resident adapters of rank ``rank`` (token t
uses adapter t mod N, so the rows are gathered through the row table, as a
served batch's interleaved requests are; the stacks hold N slots in device
memory).  ``adapters_on`` puts the op after each projection (a forward hook)
and the decode step compiles the layer with it, so the step is the graph a
served step with adapter tokens runs: the op is an opaque node between a
projection and its epilogue, and the fusions it separates (RoPE in the QKV
epilogue, the residual add, the SwiGLU program) are lost there as they are
when served.  The LoRA cost is that step against the step without adapters.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class LoraOptions:
    adapters: int
    rank: int

    @staticmethod
    def parse(text: str) -> LoraOptions:
        """``N,rank`` (``4,16``)."""
        parts = [p.strip() for p in text.split(",")]
        try:
            n, r = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"--lora wants N,rank (e.g. 4,16), got {text!r}") from None
        if not 1 <= n <= 64 or not 1 <= r <= 512:
            raise ValueError(f"--lora: 1..64 adapters of rank 1..512, got {n},{r}")
        return LoraOptions(n, r)

    @property
    def label(self) -> str:
        return f"LoRA deltas ({self.adapters} adapter{'s' * (self.adapters > 1)}, rank {self.rank})"


def projections(layer: nn.Module) -> list[nn.Linear]:
    """The layer's linear projections (what vLLM's LoRA layers wrap)."""
    return [m for m in layer.modules() if isinstance(m, nn.Linear)]


def stack_bytes(layer: nn.Module, opts: LoraOptions, dtype: torch.dtype) -> int:
    """Device memory of the layer's adapter stacks (A and B of every slot)."""
    per = sum(opts.rank * (p.in_features + p.out_features) for p in projections(layer))
    return per * opts.adapters * dtype.itemsize


class _Grouping:
    """The estimate's step as the op's source (``ops.lora.Source``): every
    slot of every layer holds weights."""

    def __init__(self, index) -> None:
        self.index = index

    def grouping(self, sampled: bool):
        return self.index

    def live(self, b0: torch.Tensor) -> None:
        return None


def _add_deltas(module: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: ``out +=`` the module's LoRA deltas (as vLLM's LoRA layer)."""
    x = args[0]
    y = out.view(-1, out.shape[-1])
    torch.ops.spyre.punica_sgmv(
        y, x.reshape(-1, x.shape[-1]), [module.spyre_lora_a], [module.spyre_lora_b], False
    )
    return out


@contextmanager
def adapters_on(layer: nn.Module, tokens: int, opts: LoraOptions, dtype: torch.dtype):
    """``layer``'s projections with adapters: stacks of ``opts.adapters`` slots
    on the card, the op after each projection, the step's ``tokens`` rows
    grouped by slot (token t on slot t mod N).  A graph compiled inside holds
    the LoRA ops."""
    from torch_spyre.ops import lora

    dev = torch.device("spyre")
    slots = np.arange(tokens) % opts.adapters
    lora.set_source(_Grouping(lora.row_index(slots, opts.adapters, tokens, dev)))
    hooks = []
    try:
        for p in projections(layer):
            k, n = p.in_features, p.out_features
            a = torch.empty(opts.adapters, 1, opts.rank, k, dtype=dtype, device=dev)
            p.register_buffer("spyre_lora_a", a, persistent=False)
            b = lora.b_stack(opts.adapters, n, opts.rank, dtype, dev)  # as served
            p.register_buffer("spyre_lora_b", b, persistent=False)
            hooks.append(p.register_forward_hook(_add_deltas))
        yield
    finally:
        for h in hooks:
            h.remove()
        for p in projections(layer):
            for name in ("spyre_lora_a", "spyre_lora_b"):
                p._buffers.pop(name, None)
        lora.set_source(None)
