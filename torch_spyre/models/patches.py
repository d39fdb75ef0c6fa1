"""The patches adapters apply to stock transformers models.

Each patch is a function ``patch(model, options) -> str | None`` that changes
the model in place and returns a one-line description of what it did (or None
when it had nothing to do, e.g. the module it targets is absent).  Patches are
found by probing: running each architecture on spyre with a small random config
and reading ``torch_spyre.fallback_counts()`` and the dispatch statistics (see
docs/models.md for what was measured); only what the card needs is patched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: a patch: (model, options) -> description of what it changed, or None
Patch = Callable[[nn.Module, Any], str | None]


# ------------------------------------------------------------------ rotary embeddings
class TabulatedRotaryEmbedding(nn.Module):
    """Drop-in replacement for a transformers ``*RotaryEmbedding`` module.

    The stock module computes ``cos(pos * inv_freq)`` and ``sin(...)`` on every
    forward.  The card's vector units have no sine or cosine: on spyre they run
    as an adapter (range reduction + polynomial, ~20 vector ops per call, and
    the reduction of angles of thousands of radians loses fp32 bits).  The
    values only depend on the position, so the original module is run once on
    the host for positions ``0..max_positions-1`` and the tables are kept as
    buffers; a forward is then one embedding lookup (a DMA gather) per table.
    """

    def __init__(self, original: nn.Module, max_positions: int, layer_types: list[str] | None):
        super().__init__()
        self.max_positions = max_positions
        self.layer_types = layer_types
        # the stock module's plain attributes stay readable (its config, rope
        # type, attention scaling: model code reads them, e.g. Granite-SWA's)
        for k, v in vars(original).items():
            if not k.startswith("_") and not hasattr(self, k):
                if not isinstance(v, torch.Tensor | nn.Module):
                    setattr(self, k, v)
        pos = torch.arange(max_positions).unsqueeze(0)
        x = torch.zeros(1, dtype=torch.float32)
        keys: list[str | None] = list(layer_types) if layer_types else [None]
        for key in keys:
            with torch.no_grad():
                args = (x, pos) if key is None else (x, pos, key)
                cos, sin = original.to("cpu")(*args)
            suffix = "" if key is None else f"_{key}"
            self.register_buffer(f"cos{suffix}", cos[0].contiguous(), persistent=False)
            self.register_buffer(f"sin{suffix}", sin[0].contiguous(), persistent=False)
        self.register_buffer(
            "sections", self._sections(original, keys[0], cos[0]), persistent=False
        )

    def _sections(self, original, key, table: torch.Tensor) -> torch.Tensor | None:
        """For a multimodal rotary (M-RoPE: ``position_ids`` of shape (3, batch,
        seq), one row each for time, height and width; each frequency takes its
        angle from one row), which row each column of the table comes from:
        found by probing the original with three distinct positions.  None for
        a plain rotary."""
        n = table.shape[0]
        if n < 8:
            return None
        probe = torch.tensor([n // 7, n // 2, n - 1]).view(3, 1, 1)
        x = torch.zeros(1, dtype=torch.float32)
        try:
            with torch.no_grad():
                cos, _ = original(x, probe) if key is None else original(x, probe, key)
        except Exception:  # noqa: BLE001 - a rotary that takes 2-D positions only
            return None
        got = cos.reshape(-1)[-table.shape[-1] :]
        rows = table[probe.view(-1)]  # [3, dim]
        # (a probe answer of another width, dots3's partial rotary, is no M-RoPE)
        if got.numel() == rows.shape[1] and not torch.allclose(got, rows[0]):
            return (got[None, :] - rows).abs().argmin(0)
        return None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        suffix = "" if layer_type is None else f"_{layer_type}"
        cos_t: torch.Tensor = getattr(self, f"cos{suffix}")
        sin_t: torch.Tensor = getattr(self, f"sin{suffix}")
        # position_ids (batch, seq) -> (batch, seq, head_dim): a gather, no trig on the card.
        # Out-of-range positions raise in the lookup (no silent wrong answer); checking
        # position_ids.max() up front would cost a device->host sync per forward.
        try:
            if position_ids.dim() == 3 and self.sections is not None:
                # M-RoPE: each column's angle from its row of the (3, b, s) ids
                cos = sin = 0
                for row in range(position_ids.shape[0]):
                    keep = (self.sections == row).to(cos_t.dtype)
                    ids = position_ids[row]
                    cos = cos + nn.functional.embedding(ids, cos_t) * keep
                    sin = sin + nn.functional.embedding(ids, sin_t) * keep
            else:
                if position_ids.dim() == 3:  # (3, b, s) of a text-only model: rows equal
                    position_ids = position_ids[0]
                cos = nn.functional.embedding(position_ids, cos_t)
                sin = nn.functional.embedding(position_ids, sin_t)
        except IndexError as e:
            raise IndexError(
                f"rotary table holds positions 0..{self.max_positions - 1}; for longer "
                "sequences pass torch_spyre.models.prepare(..., max_positions=N)"
            ) from e
        return cos.to(x.dtype), sin.to(x.dtype)


def _find_rotary(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every rotary-embedding module."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "config"):
                found.append((parent, name, child))
    return found


def tabulate_rotary(model: nn.Module, options: Any) -> str | None:
    """Replace rotary embeddings by host-precomputed cos/sin tables (see above)."""
    done = []
    for parent, name, rope in _find_rotary(model):
        cfg = rope.config
        rope_types = getattr(rope, "rope_type", "default")
        kinds = set(rope_types.values()) if isinstance(rope_types, dict) else {rope_types}
        if "dynamic" in kinds or "longrope" in kinds:
            # these rescale inv_freq with the sequence length: a fixed table would be wrong
            continue
        limit = getattr(cfg, "max_position_embeddings", None) or options.max_positions
        n = min(limit, options.max_positions)
        layer_types = getattr(rope, "layer_types", None)
        try:
            table = TabulatedRotaryEmbedding(rope, n, layer_types)
        except (TypeError, ValueError, KeyError) as err:
            # a rotary of another form (Llama-4's complex frequencies, one
            # value not a (cos, sin) pair; layer types it does not key by):
            # kept as it is, its trig running as eager ops on the card
            done.append(f"{name}: kept ({type(err).__name__}: {err})")
            continue
        setattr(parent, name, table)
        tables = len(layer_types) if layer_types else 1
        done.append(f"{name}: {tables} cos/sin table(s) of {n} positions")
    return "; ".join(done) or None


# ------------------------------------------------------------------ output projection
class ChunkedLinear(nn.Module):
    """An output projection split over its output features (the vocabulary).

    One core of a matmul addresses at most ``per_core_span_bytes`` of device
    memory (256 MiB on the card, torch_spyre/hardware.py): a Gemma-3
    lm_head (262144 x 640 fp32 = 640 MiB) is rejected as one kernel and would
    run through the host fallback every forward, copying the weight over PCIe.
    A core's span is at most the size of the operand it reads, so chunks of at
    most half the span always plan; the logits are the concatenation.

    The chunks are copies (buffers): the original weight stays registered, as
    it is usually tied to the input embedding (cost: one more copy of the
    weight in device memory).
    """

    def __init__(self, linear: nn.Linear, rows: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept: tied to the embedding, seen by get_output_embeddings
        self.rows = rows
        w = linear.weight.detach()
        b = None if linear.bias is None else linear.bias.detach()
        self.n_chunks = -(-w.shape[0] // rows)
        for i in range(self.n_chunks):
            sl = slice(i * rows, (i + 1) * rows)
            self.register_buffer(f"w{i}", w[sl].clone(), persistent=False)
            self.register_buffer(f"b{i}", None if b is None else b[sl].clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [
            nn.functional.linear(x, getattr(self, f"w{i}"), getattr(self, f"b{i}"))
            for i in range(self.n_chunks)
        ]
        return torch.cat(parts, dim=-1)


def chunk_lm_head(model: nn.Module, options: Any) -> str | None:
    """Split an output projection too large for one matmul kernel (see ChunkedLinear)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None
    limit = options.max_linear_bytes
    if limit is None:
        from torch_spyre.runtime import cards

        limit = cards.config().per_core_span_bytes // 2
    # sized for fp32 (the widest dtype the card takes): also safe after a cast to 16 bits
    row_bytes = head.in_features * 4
    if head.out_features * row_bytes <= limit:
        return None
    chunks = -(-head.out_features * row_bytes // limit)
    rows = -(-head.out_features // chunks)
    rows = -(-rows // 64) * 64  # whole sticks of 16-bit values
    model.set_output_embeddings(ChunkedLinear(head, rows))
    return (
        f"lm_head: {head.out_features} outputs in {-(-head.out_features // rows)} chunks of {rows}"
    )


# ------------------------------------------------------------------ attention
def sdpa_attention(model: nn.Module, options: Any) -> str | None:
    """Route attention through ``scaled_dot_product_attention``.

    SDPA is the path the card's kernels (and later the compiled attention
    pattern) are written for: one fused op with the mask, instead of the eager
    python matmul/softmax/dropout sequence with an explicitly materialised mask.
    """
    _grouped_heads_with_masks()
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) == "sdpa":
        return None
    if not getattr(model, "_supports_sdpa", False):
        return None
    model.set_attn_implementation("sdpa")
    return "attention: sdpa"


def _grouped_heads_with_masks() -> None:
    """Let transformers' SDPA path pass grouped KV heads (``enable_gqa``) with
    a mask for spyre tensors, instead of copying each KV head out to its
    query heads (``repeat_kv``): the card's flash-attention kernel reads each
    KV head once per group and takes the mask.  Other devices keep
    transformers' own rule.  Process-wide, installed once."""
    from transformers.integrations import sdpa_attention as sdpa

    stock = sdpa.use_gqa_in_sdpa
    if getattr(stock, "_spyre", False):
        return

    def use_gqa_in_sdpa(attention_mask, key, value):
        if key.device.type == "spyre":
            return key.shape[-1] == value.shape[-1]
        return stock(attention_mask, key, value)

    use_gqa_in_sdpa._spyre = True  # type: ignore[attr-defined]
    sdpa.use_gqa_in_sdpa = use_gqa_in_sdpa
