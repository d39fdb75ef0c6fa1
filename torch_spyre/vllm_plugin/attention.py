"""SPYRE_ATTN: vLLM attention backend over a paged KV cache in spyre device memory.

KV cache, one tensor per layer on the card: ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (keys then values, token-major pages like vLLM's
FlashAttention "NHD" layout), allocated by the model runner. Seen as
``[2, num_blocks * block_size, kv_heads, head_size]`` a token's slot
(``block * block_size + offset``, vLLM's slot mapping) is one row.

Per step the metadata builder (host) turns vLLM's varlen batch (query_start_loc,
seq_lens, block_table) into a few index tensors, moved to the card once and shared
by every layer:

* ``slots``: where this step's new keys/values go (``index_copy_`` into the pages);
* requests in two groups, decodes (one query token) and the rest, so that a
  prefill in the batch does not pad every decode to its length; per group:
  ``q_rows`` [R, Q] int32: the token row of each query position, padded to the
  longest query Q (-1); ``kv_rows`` [R, S] int32: the cache slot of each
  context position, padded to the group's longest context rounded up to whole
  pages (-1, masked out); ``mask`` [R, 1, Q, S]: causal within the request,
  offset by the cached context (chunked prefill and prefix-cache hits are the
  same case: queries start at ``seq_len - query_len``), windowed for
  sliding-window layers.

Each layer then runs, per group, one paged-attention kernel program
(``spyre::paged_attention``, ops/paged_attention.py): the cores read the
group's slot table and the K/V pages where they lie in the cache (one DMA
descriptor per page, no gathered copy), the flash-attention loop in LX, and
each query's output row written to its token's row; decode and prefill
alike, soft-capped logits and sinks included (one program per page of context
growth, not per token).  Encoder-only attention (no cache: keys are the step's
tokens; ``q_index``/``kv_index`` token rows, ``out_index`` [T] each token's row
in the groups' concatenated results) gathers keys, values and queries with
index_select and runs one batched SDPA per group.
With the compiled forward (compile.py) this runs inside vLLM's opaque attention
custom ops, outside the compiled programs; rows of the bucket's padding (past
``num_actual_tokens``) are never written to the cache and their output is zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

SPYRE = torch.device("spyre")


class SpyreAttentionBackend(AttentionBackend):
    # The KV write is a separate call (do_kv_cache_update), as vLLM's unified
    # attention path expects when this is False.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM's backend enum is closed; out-of-tree backends take its CUSTOM slot
        # (registered by register_backend below).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SpyreAttentionImpl]:
        return SpyreAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreAttentionMetadataBuilder]:
        return SpyreAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # encoder-only: embedding and cross-encoder models (pooling runner)
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, **_: object
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


@dataclass
class AttentionGroup:
    """Requests attended together: queries padded to ``max_query_len``, contexts
    to ``max_seq_len`` (host ints); the index tensors live on the card."""

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    mask: torch.Tensor  # [R, 1, Q, S] bool: causal after the cached context, no padding
    # paged (decoder) attention, the paged-attention program's tables:
    q_rows: torch.Tensor | None = None  # [R, Q] int32: token row of each query, -1 padding
    kv_rows: torch.Tensor | None = None  # [R, S] int32: cache slot of each context position
    # encoder-only attention (keys are the step's tokens), gathered by index_select:
    q_index: torch.Tensor | None = None  # [R*Q] int64: token row of each padded query
    kv_index: torch.Tensor | None = None  # [R*S] int64: token row of each padded key


@dataclass
class SpyreAttentionMetadata:
    num_actual_tokens: int
    slots: torch.Tensor  # [T] int32, spyre: where this step's keys/values go
    groups: list[AttentionGroup]
    out_index: torch.Tensor | None  # [T] int64, spyre: each token's row in the groups' outputs
    block_size: int = 16


def _group_indices(
    reqs: torch.Tensor,
    qsl: torch.Tensor,
    seq: torch.Tensor,
    table: torch.Tensor | None,
    block_size: int,
    causal: bool = True,
    window: int | None = None,
) -> dict:
    """``table`` None: keys and values are the step's own tokens (encoder-only
    attention, bidirectional within a request: ``kv_index`` then holds token
    rows, not cache slots).  ``window``: each query sees the last ``window``
    positions up to its own (sliding-window attention)."""
    q_lens = qsl[reqs + 1] - qsl[reqs]
    seq = seq[reqs] if table is not None else q_lens
    ctx = seq - q_lens  # tokens already in the cache before this step
    r, q_max, s_max = len(reqs), int(q_lens.max()), int(seq.max())
    if table is not None:
        # whole pages (the kernel reads pages): one program per block_size of
        # context growth, not one per token
        s_max = -(-s_max // block_size) * block_size

    j = torch.arange(q_max, dtype=torch.int64)
    s = torch.arange(s_max, dtype=torch.int64)
    q_valid = j[None, :] < q_lens[:, None]  # [R, Q]
    q_index = torch.where(q_valid, qsl[reqs, None] + j[None, :], 0)

    s_valid = s[None, :] < seq[:, None]  # [R, S]
    if table is None:
        kv_index = torch.where(s_valid, qsl[reqs, None] + s[None, :], 0)
    else:
        rows = table[reqs]
        cols = (s // block_size).clamp(max=rows.shape[1] - 1).expand(r, -1)
        blk = torch.gather(rows, 1, cols)
        kv_index = torch.where(s_valid, blk * block_size + s % block_size, 0)

    pos = ctx[:, None, None] + j[None, :, None]  # [R, Q, 1]: each query's position
    mask = s_valid[:, None, :] & q_valid[:, :, None]
    if causal:
        mask = mask & (s[None, None, :] <= pos)
    if window is not None:
        mask = mask & (pos - s[None, None, :] < window)
    # A padded query row must not be all False (SDPA would give NaN); let it see
    # position 0 — its output is never read back.
    mask[:, :, 0] |= ~q_valid
    out = {"num_reqs": r, "max_query_len": q_max, "max_seq_len": s_max, "mask": mask[:, None]}
    if table is None:
        out.update(q_index=q_index.reshape(-1), kv_index=kv_index.reshape(-1))
    else:
        out.update(
            q_rows=torch.where(q_valid, q_index, -1).to(torch.int32),
            kv_rows=torch.where(s_valid, kv_index, -1).to(torch.int32),
        )
    return out


def build_indices(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    block_size: int,
    causal: bool = True,
    window: int | None = None,
) -> tuple[list[dict], torch.Tensor]:
    """Host-side index tensors for one step (see the module docstring).

    Decodes (one query token) and the other requests form separate groups, so a
    long prefill in the batch does not pad every decode to its query length.
    Returns the groups and ``out_index`` (token -> row of the groups' outputs,
    concatenated in group order).
    """
    qsl = query_start_loc.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    num_reqs = seq.shape[0]
    q_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    table = None if block_table is None else block_table[:num_reqs].to(torch.int64)
    num_tokens = int(qsl[num_reqs])

    row_of_token = torch.zeros(num_tokens, dtype=torch.int64)
    groups: list[dict] = []
    offset = 0
    for reqs in ((q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten()):
        if len(reqs) == 0:
            continue
        g = _group_indices(reqs, qsl, seq, table, block_size, causal, window)
        for k, req in enumerate(reqs.tolist()):
            lo, hi = int(qsl[req]), int(qsl[req + 1])
            base = offset + k * g["max_query_len"]
            row_of_token[lo:hi] = torch.arange(base, base + hi - lo)
        offset += g["num_reqs"] * g["max_query_len"]
        groups.append(g)
    return groups, row_of_token


class SpyreAttentionMetadataBuilder(AttentionMetadataBuilder[SpyreAttentionMetadata]):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # sliding-window layers have their own KV cache group (and builder)
        self.window = getattr(kv_cache_spec, "sliding_window", None)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SpyreAttentionMetadata:
        m = common_attn_metadata
        if not isinstance(m.causal, bool):
            raise NotImplementedError("spyre attention: per-request causality is not supported")
        n = m.num_actual_tokens
        # not causal: encoder-only attention (no KV cache: keys are the step's tokens)
        groups, out_index = build_indices(
            m.query_start_loc_cpu,
            m.seq_lens.cpu(),
            m.block_table_tensor.cpu() if m.causal else None,
            self.block_size,
            causal=m.causal,
            window=self.window,
        )
        # One host->device copy per index tensor per step, shared by all layers.
        return SpyreAttentionMetadata(
            num_actual_tokens=n,
            slots=m.slot_mapping[:n].to(torch.int32).to(SPYRE),
            groups=[to_card(g) for g in groups],
            # paged groups write their tokens' rows themselves
            out_index=None if m.causal else out_index.to(SPYRE),
            block_size=self.block_size,
        )


def to_card(group: dict) -> AttentionGroup:
    return AttentionGroup(
        **{k: v.to(SPYRE) if isinstance(v, torch.Tensor) else v for k, v in group.items()}
    )


class SpyreAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto",
            f"attn_type={attn_type}": attn_type
            not in (AttentionType.DECODER, AttentionType.ENCODER_ONLY),
        }
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise NotImplementedError(f"spyre attention does not support: {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sliding_window = sliding_window  # applied by the builder's mask
        self.soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.sinks = sinks  # [H] per-head logit of a virtual "sink" key (gpt-oss)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta[layer.layer_name]
        if meta is None or kv_cache.numel() == 0 or self.attn_type != AttentionType.DECODER:
            return  # profiling / warm-up; encoder-only attention keeps no cache
        n = meta.num_actual_tokens
        kvh, d = self.num_kv_heads, self.head_size
        torch.ops.spyre.kv_cache_write(
            kv_cache, key[:n].reshape(n, kvh, d), value[:n].reshape(n, kvh, d), meta.slots
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SpyreAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on spyre")
        if attn_metadata is None:  # profiling run: no cache yet
            return output.zero_()
        m = attn_metadata
        n = m.num_actual_tokens
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_size
        if self.attn_type != AttentionType.ENCODER_ONLY:
            # one paged-attention program per group, each writing its tokens' rows
            # of the output (its whole storage in place when the layouts agree)
            for g in m.groups:
                torch.ops.spyre.paged_attention(
                    output, query, kv_cache, g.q_rows, g.kv_rows, g.mask, self.scale,
                    self.soft_cap or 0.0, self.sinks, m.block_size,
                )  # fmt: skip
            if output.shape[0] > n:
                output[n:].zero_()  # a compiled bucket's padding rows: defined values
            return output
        # encoder-only: keys are this step's tokens
        keys, values = key[:n].view(-1, kvh, d), value[:n].view(-1, kvh, d)
        position_bias = getattr(layer, "spyre_position_bias", None)
        outs = []
        for g in m.groups:
            r, q_max, s_max = g.num_reqs, g.max_query_len, g.max_seq_len
            k = keys.index_select(0, g.kv_index).view(r, s_max, kvh, d).transpose(1, 2)
            v = values.index_select(0, g.kv_index).view(r, s_max, kvh, d).transpose(1, 2)
            q = query[:n].index_select(0, g.q_index).view(r, q_max, h, d).transpose(1, 2)
            bias = None
            if position_bias is not None:  # a learned bias by key - query distance (MPNet)
                rel = torch.arange(s_max)[None, :] - torch.arange(q_max)[:, None]
                bias = position_bias(rel)[None]  # [1, H, Q, S]
            o = self._attend(q, k, v, g.mask, bias)  # [R, H, Q, D]
            outs.append(o.transpose(1, 2).reshape(r * q_max, h, d))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        output[:n].copy_(o.index_select(0, m.out_index).to(output.dtype))
        if output.shape[0] > n:
            # rows of a compiled bucket's padding: defined values (never read back)
            output[n:].zero_()
        return output

    def _attend(self, q, k, v, mask: torch.Tensor, bias: torch.Tensor | None = None):
        """Attention of [R, H, Q, D] queries over [R, KVH, S, D] keys/values.

        One SDPA kernel, unless the logits are soft-capped (gemma2), biased
        (MPNet's relative positions) or there are attention sinks: then the
        scores, cap, bias, masked softmax and weighted sum as the card's matmul,
        vector and softmax kernels.
        """
        h, kvh = q.shape[1], k.shape[1]
        if self.soft_cap is None and self.sinks is None and bias is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=(h != kvh)
            )
        if h != kvh:
            k = k.repeat_interleave(h // kvh, dim=1)
            v = v.repeat_interleave(h // kvh, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        if self.soft_cap is not None:
            scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        if bias is not None:
            scores = scores + bias.float()
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.to(scores.device, torch.float32).view(1, h, 1, 1)
            scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs.to(v.dtype), v)


BACKEND_QUALNAME = f"{SpyreAttentionBackend.__module__}.{SpyreAttentionBackend.__qualname__}"


def register_backend() -> str:
    """Put SpyreAttentionBackend in vLLM's CUSTOM backend slot; returns its path."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as _register

    _register(AttentionBackendEnum.CUSTOM, BACKEND_QUALNAME)
    return BACKEND_QUALNAME
