"""Multi-LoRA serving on the card: the punica wrapper and the adapters' weight stacks.

vLLM's LoRA layers wrap the model's projections and ask the platform's punica
wrapper (``SpyrePlatform.get_punica_wrapper``, the public hook) to add each
batch's adapter deltas.  Here:

* **the weight stacks live on the card.**  vLLM allocates each LoRA layer's
  ``lora_a_stacked`` / ``lora_b_stacked`` (``[max_loras, 1, r, K]`` /
  ``[max_loras, 1, N, r]``) on the runner's device, the host for this
  CPU-typed runner; ``stacks_to_card`` (called by the model runner right
  after vLLM wraps the layers) replaces them with card tensors, registered as
  the layers' buffers so compiled graphs take them as inputs like weights.
  vLLM's ``set_lora`` / ``reset_lora`` then write an adapter into its slot
  of the card stacks when it is activated (host-to-card copies).
* **the punica metadata goes to the card each step.**  ``update_metadata``
  groups the step's LoRA tokens by adapter slot on the host (vLLM's mapping
  is host state): tokens per slot, the tokens in slot order (int64 and the
  kernel's int32 row table) and each token's grouped row, the last three
  copied into fixed card buffers (three small copies per step, only when the
  step has LoRA tokens); the same for the sampled rows (the LM head).
* **one program per projection.**  ``add_lora_linear`` is the op
  ``spyre::punica_sgmv``: the grouped shrink/expand kernel of every slice of
  the projection for the whole batch (``ops/lora.py``, ``kernels/lora.py``),
  an opaque node in compiled graphs that reads the step's grouping when it
  runs.  A slice or a layer the step's adapters hold no weights for runs
  nothing (``track_live_slots``); a step without LoRA tokens runs a graph
  without the LoRA calls (``_step_has_lora``).

vLLM wraps the embedding and the logits processor too: the embedding's LoRA
gathers its ``A`` rows by token id on the card and runs the same grouped
program without the shrink; the LM head's runs on the sampled rows, grouped
by their own slots.  The fully sharded (S-LoRA) path and full-weight adapter
modules are refused with an error naming them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

from torch_spyre.ops import lora as lora_ops

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAMapping

SPYRE = torch.device("spyre")


class SpyrePunicaWrapper(PunicaWrapperBase):
    """Punica metadata on the host and the card; the LoRA deltas as card programs."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        max_batches: int,
        device: torch.device | str,
        **kwargs: Any,
    ) -> None:
        # vLLM's base metadata (token -> slot, sampler indices) stays on the host,
        # where vLLM computes it; the grouping the kernels read is on the card.
        super().__init__(max_num_batched_tokens, max_batches, "cpu")
        lora_config = kwargs.get("lora_config")
        self.slots = int(lora_config.max_loras) if lora_config is not None else 0
        #: the step's grouping: of its tokens (projections) and sampled rows (LM head)
        self.tokens = Grouping(self.slots, max_num_batched_tokens)
        self.sampled = Grouping(self.slots, max_num_batched_tokens)
        # the embedding's LoRA gathers its A rows on the card by token id plus
        # this offset (vLLM writes it in _update_base_metadata: host to card)
        self._embeddings_indices = torch.zeros(
            max_num_batched_tokens, dtype=torch.int64, device=SPYRE
        )
        lora_ops.set_source(self)

    def update_metadata(
        self,
        mapping: LoRAMapping,
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self.tokens.update(self.token_lora_indices.numpy())
        self.sampled.update(self.sampler_indices.numpy())
        global _step_has_lora
        lora_ops.set_source(self)
        _step_has_lora = any(self.tokens.counts)

    # -- what the op spyre::punica_sgmv reads when it runs (ops/lora.py) ---------
    def grouping(self, sampled: bool) -> lora_ops.RowIndex:
        return (self.sampled if sampled else self.tokens).index

    def live(self, b0: torch.Tensor) -> tuple[tuple[bool, ...], ...] | None:
        live = _live.get(b0.data_ptr())
        return None if live is None else _as_tuple(live)

    # -- what the LoRA layers call ------------------------------------------
    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if scale != 1.0:
            raise NotImplementedError(f"spyre LoRA: scale {scale} (vLLM folds it into B)")
        if tuple(b.shape[2] for b in lora_b_stacked) != tuple(output_slices):
            raise NotImplementedError(
                f"spyre LoRA: output slices {output_slices} differ from the B stacks' "
                f"{[b.shape[2] for b in lora_b_stacked]}"
            )
        if y.dim() != 2 or x.dim() != 2:
            raise NotImplementedError(f"spyre LoRA: y {tuple(y.shape)}, x {tuple(x.shape)}")
        if not _step_has_lora:
            return y  # see _step_has_lora
        torch.ops.spyre.punica_sgmv(y, x, list(lora_a_stacked), list(lora_b_stacked), False)
        return y

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        raise NotImplementedError(_REFUSED.format(what="fully sharded LoRA (add_shrink)"))

    def add_expand(
        self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kw
    ):
        raise NotImplementedError(_REFUSED.format(what="fully sharded LoRA (add_expand)"))

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``y += x @ B[slot]^T``: the embedding's expand (its A rows were gathered
        by token id), the same grouped program without the shrink."""
        if y.dim() != 2 or x.dim() != 2:
            raise NotImplementedError(f"spyre LoRA: y {tuple(y.shape)}, x {tuple(x.shape)}")
        if not _step_has_lora:
            return y
        torch.ops.spyre.punica_sgmv(y, x.to(lora_b_stacked.dtype), [], [lora_b_stacked], False)
        return y

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The LM head's adapters on the sampled rows (grouped by the sampler's slots)."""
        if scale != 1.0 or y.dim() != 2 or x.dim() != 2:
            raise NotImplementedError(
                f"spyre LoRA logits: scale {scale}, y {tuple(y.shape)}, x {tuple(x.shape)}"
            )
        torch.ops.spyre.punica_sgmv(y, x, [lora_a_stacked], [lora_b_stacked], True)
        return y

    def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        raise NotImplementedError(_REFUSED.format(what="full-weight adapter modules"))


_REFUSED = (
    "spyre: {what} is not supported on the card; serve adapters on the decoder's linear "
    "projections (q/k/v/o, gate/up/down)"
)

#: the step has tokens with an adapter.  The LoRA layers' calls are skipped when
#: it is False, and Dynamo guards on it: each token bucket compiles two graphs, one
#: without the LoRA ops (a step of base-model requests keeps the compiler's fusions,
#: e.g. the QKV matmul with the rotary epilogue, the SwiGLU MLP) and one with them
_step_has_lora = False


@contextmanager
def lora_graph() -> Iterator[None]:
    """Run the forward as a step with adapter tokens (the model runner's warm-up
    compiles each bucket's LoRA graph with it; no token has a slot, so the LoRA
    ops run nothing)."""
    global _step_has_lora
    before, _step_has_lora = _step_has_lora, True
    try:
        yield
    finally:
        _step_has_lora = before


class Grouping:
    """One grouping of rows by adapter slot: host counts, card index buffers."""

    def __init__(self, slots: int, max_rows: int) -> None:
        self.index = lora_ops.RowIndex(
            (0,) * slots,
            torch.zeros(max_rows, dtype=torch.int64, device=SPYRE),
            torch.zeros((max_rows, 1), dtype=torch.int32, device=SPYRE),
            torch.zeros(max_rows, dtype=torch.int64, device=SPYRE),
        )
        self.slots, self.max_rows = slots, max_rows

    @property
    def counts(self) -> tuple[int, ...]:
        return self.index.counts

    def update(self, slot_of_row: np.ndarray) -> None:
        """Group the step's rows (-1: base model); the index tables go to the
        card (three copies into the fixed buffers) when some row has an adapter."""
        counts, rows, inv = lora_ops.group_rows(slot_of_row, self.slots, self.max_rows)
        if any(counts):
            self.index.rows.copy_(torch.from_numpy(rows))
            self.index.rows32.copy_(torch.from_numpy(rows.astype(np.int32)).reshape(-1, 1))
            self.index.inv.copy_(torch.from_numpy(inv))
        self.index.counts = counts
        self.index.starts = lora_ops.runs(counts, rows)


#: which slots hold weights, per LoRA layer ([slice, slot] booleans), keyed by the
#: card address of the layer's first B stack (what the op is handed)
_live: dict[int, np.ndarray] = {}


def _as_tuple(live: np.ndarray) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(bool(v) for v in row) for row in live)


def track_live_slots(m: torch.nn.Module, slices: int, slots: int) -> np.ndarray:
    """Record which adapter slots of LoRA layer ``m`` hold weights, per slice.

    vLLM activates an adapter by calling each LoRA layer's ``set_lora`` (the
    slices the adapter has weights for; ``None`` for the others) or, for a
    layer the adapter does not touch, ``reset_lora`` (zeros).  No public hook
    tells the platform which slots of a layer are zero, and the punica wrapper
    is handed only the stacks; so the layer's two methods are wrapped on the
    instance, and a (slice, slot) without weights runs no phase (an adapter
    on q and v costs nothing in the MLP).  vLLM 0.32.0.
    test_vllm_lora.py::test_mixed_adapter_batch_equals_peft fails if this
    stops being called (the live table stays empty: adapters would be skipped).
    """
    live = np.zeros((slices, slots), dtype=bool)
    set_lora, reset_lora = m.set_lora, m.reset_lora

    def reset(index: int) -> None:
        reset_lora(index)
        live[:, index] = False

    def set_(index: int, lora_a, lora_b) -> None:
        set_lora(index, lora_a, lora_b)  # calls self.reset_lora first
        parts = lora_a if isinstance(lora_a, list | tuple) else [lora_a]
        for i, t in enumerate(parts):
            live[i, index] = t is not None

    m.reset_lora = reset
    m.set_lora = set_
    return live


def stacks_to_card(model: torch.nn.Module) -> int:
    """Every LoRA layer's weight stacks as card tensors (zeros: no adapter is
    active yet), registered as buffers; returns the device bytes they take
    (allocated: a stack's stick padding included)."""
    from vllm.lora.layers.base import BaseLayerWithLoRA
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    before = torch.spyre.memory_allocated()
    for name, m in model.named_modules():
        if not isinstance(m, BaseLayerWithLoRA):
            continue
        if isinstance(m, VocabParallelEmbeddingWithLoRA | LogitsProcessorWithLoRA):
            for attr in ("lora_a_stacked", "lora_b_stacked"):
                _to_card(m, attr, 0, getattr(m, attr))
                setattr(m, attr, getattr(m, f"spyre_{attr}_0"))
            if isinstance(m, VocabParallelEmbeddingWithLoRA):
                a = m.lora_a_stacked
                m.lora_a_stacked_2d = a.view(a.shape[0] * a.shape[1], a.shape[2])
            _live[m.lora_b_stacked.data_ptr()] = track_live_slots(m, 1, m.lora_b_stacked.shape[0])
            continue
        if not isinstance(m, BaseLinearLayerWithLoRA):
            raise NotImplementedError(_REFUSED.format(what=f"LoRA on {name} ({type(m).__name__})"))
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            stacks = getattr(m, attr)
            for i, t in enumerate(stacks):
                _to_card(m, attr, i, t)
            setattr(m, attr, tuple(getattr(m, f"spyre_{attr}_{i}") for i in range(len(stacks))))
        m.device = SPYRE
        b0 = m.lora_b_stacked[0]
        _live[b0.data_ptr()] = track_live_slots(m, len(m.lora_b_stacked), b0.shape[0])
    return torch.spyre.memory_allocated() - before


def _to_card(m: torch.nn.Module, attr: str, i: int, t: torch.Tensor) -> None:
    """A zero card tensor like host stack ``t``, buffer ``spyre_{attr}_{i}`` of ``m``.

    A B stack [L, 1, n, r] is the transposed view of an [L, 1, r, n] card
    tensor (``ops.lora.b_stack``: whole sticks of n, not a stick per row for a
    rank under one); vLLM's ``set_lora`` / ``reset_lora`` write through the view."""
    if attr == "lora_b_stacked" and t.dim() == 4:
        c = lora_ops.b_stack(t.shape[0], t.shape[2], t.shape[3], t.dtype, SPYRE)
    else:
        c = torch.zeros(t.shape, dtype=t.dtype, device=SPYRE)
    m.register_buffer(f"spyre_{attr}_{i}", c, persistent=False)
