"""``spyre estimate --lora N,rank``: the LoRA programs of a decode step, modelled.

Every linear projection of a decoder layer (attention and MLP; vLLM's LoRA
layers wrap the same ones) gets the program a served step runs for it:
``ops.lora.sgmv_add_``, one grouped shrink/expand launch per projection over
the step's tokens, here ``batch`` decode tokens spread over ``N`` resident
adapters of rank ``rank`` (token t uses adapter t mod N; the stacks hold N
slots in device memory).  The programs run on the card in timing-only mode
and their modelled time is a part of the decode step
(``"LoRA deltas (N adapters, rank r)"``), counted once per layer of the kind.

What it does not count: in a served step the LoRA op sits between a
projection and its epilogue, so those epilogues (RoPE, the residual add, the
SwiGLU program) run apart; the vLLM measurement of that is in
docs/serving.md ("Multi-LoRA").  The part is the adapters' own programs.
"""

from __future__ import annotations

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


def run_deltas(layer: nn.Module, tokens: int, opts: LoraOptions, dtype: torch.dtype) -> None:
    """The step's LoRA programs for ``layer``'s projections on ``tokens`` rows."""
    from torch_spyre.ops import lora

    dev = torch.device("spyre")
    slots = np.arange(tokens) % opts.adapters
    index = lora.row_index(slots, opts.adapters, tokens, dev)
    for p in projections(layer):
        k, n = p.in_features, p.out_features
        a = torch.empty(opts.adapters, 1, opts.rank, k, dtype=dtype, device=dev)
        b = torch.empty(opts.adapters, 1, n, opts.rank, dtype=dtype, device=dev)
        x = torch.empty(tokens, k, dtype=dtype, device=dev)
        y = torch.empty(tokens, n, dtype=dtype, device=dev)
        lora.sgmv_add_(y, x, index, [a], [b])
