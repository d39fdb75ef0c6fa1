"""SPYRE_MLA: multi-head latent attention (DeepSeek-V2/V3) served from the latent cache.

The cache holds, per token and layer, one row of ``kv_lora_rank +
qk_rope_head_dim`` values: the normalised latent ``kv_c`` and the rotated
shared key ``k_pe`` (vLLM's ``MLAAttentionSpec``: one "head" of that size, no
separate values), in one card tensor per layer ``[num_blocks, 1, block_size,
latent]`` (vLLM's MLA layer binds it as ``[num_blocks, block_size, latent]``).
Nothing is expanded to per-head keys and values in the cache.

vLLM's own ``MLAAttention.forward_impl`` runs the layer (device-agnostic torch
code): it splits the step into decodes (first, one query token each: the
builder asks vLLM to reorder the batch) and the rest, absorbs the decode
queries through ``W_UK`` (``q_nope @ W_UK_T`` per head) and projects the decode
output through ``W_UV``, both ``bmm`` on the card.  This module supplies what
it calls:

* ``do_kv_cache_update``: the step's ``[kv_c | k_pe]`` rows into their slots
  (one ``index_copy_`` on the card);
* ``forward_mqa`` (decode, absorbed): the queries ``[q_nope W_UK | q_pe]`` attend
  over the requests' latent rows gathered from the cache, as multi-query
  attention with one key head of the latent size whose values are the same
  rows (the output's first ``kv_lora_rank`` lanes are ``softmax(qK^T) kv_c``);
* ``forward_mha`` (prefill, chunked prefill, prefix-cache hits): each request's
  latent context is gathered from the cache (this step's rows included: they
  are written first) and up-projected through ``kv_b_proj`` to per-head keys and
  values for this step only, then causal attention with the cached context as
  the offset (the masks of attention.py's builder).

All of it is torch ops on spyre tensors (gathers, matmuls, SDPA); the index
tensors are built on the host once per step and moved to the card once,
shared by every layer.  ``VLLM_MLA_DISABLE=1`` serves the same models in the
expanded form through attention.py instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NoReturn

import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import (
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
from vllm.v1.kv_cache_interface import AttentionSpec

from torch_spyre.vllm_plugin.attention import build_indices

SPYRE = torch.device("spyre")


class SpyreMLABackend(MLACommonBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "SPYRE_MLA"

    @staticmethod
    def get_impl_cls() -> type[SpyreMLAImpl]:
        return SpyreMLAImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreMLAMetadataBuilder]:
        return SpyreMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent size (torch ops, no fixed-size kernel)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, **_: object
    ) -> tuple[int, ...]:
        """``[num_blocks, 1, block_size, latent]``: what ``MLAAttention.bind_kv_cache``
        takes (it drops the head dim)."""
        if num_kv_heads != 1:
            raise ValueError(f"spyre MLA: one latent per token, got {num_kv_heads} kv heads")
        return (num_blocks, 1, block_size, head_size)


@dataclass
class LatentGroup:
    """Requests attended together (decodes, or the rest), padded to the
    longest query Q and the longest context S rounded up to whole pages.
    Index tensors on the card, int64."""

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    kv_index: torch.Tensor  # [R*S]: cache slot of each context position (padding: 0, masked)
    mask: torch.Tensor  # [R, 1, Q, S] bool: causal after the cached context, no padding
    q_index: torch.Tensor  # [R*Q]: the group's token row of each padded query (padding: 0)
    out_index: torch.Tensor  # [T_group]: each of the group's tokens' row in [R*Q]


@dataclass
class SpyreMLAMetadata:
    """What ``MLAAttention.forward_impl`` reads (the counts) and what the spyre
    impl attends with.  Decodes are the first ``num_decode_tokens`` tokens."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slots: torch.Tensor  # [T] int64, card: cache slot of each of this step's tokens
    decode: LatentGroup | None
    prefill: LatentGroup | None


def build_groups(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> tuple[int, list[dict]]:
    """Host index tensors of one step: (num_decodes, groups).  A decode is a
    request of one query token (so ``num_decode_tokens == num_decodes``).

    The groups of attention.py's ``build_indices`` (decodes, then the other
    requests), with token rows counted from each group's first token, as
    forward_impl hands each path its own slice of the step."""
    qsl = query_start_loc.to(torch.int64)
    num_reqs = seq_lens.shape[0]
    q_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    num_decodes = int((q_lens == 1).sum())
    if not bool((q_lens[:num_decodes] == 1).all()):
        raise RuntimeError(
            "spyre MLA: the batch is not ordered decodes first (vLLM reorders it for "
            "builders with reorder_batch_threshold=1)"
        )
    groups, row_of_token = build_indices(query_start_loc, seq_lens, block_table, block_size)
    out: list[dict] = []
    token0 = row0 = 0
    for g in groups:
        r, q, s = g["num_reqs"], g["max_query_len"], g["max_seq_len"]
        tokens = int((g["q_rows"] >= 0).sum())
        q_rows = g["q_rows"].to(torch.int64)
        out.append(
            {
                "num_reqs": r,
                "max_query_len": q,
                "max_seq_len": s,
                "kv_index": g["kv_rows"].to(torch.int64).clamp(min=0).reshape(-1),
                "mask": g["mask"],
                "q_index": torch.where(q_rows >= 0, q_rows - token0, 0).reshape(-1),
                "out_index": row_of_token[token0 : token0 + tokens] - row0,
            }
        )
        token0 += tokens
        row0 += r * q
    return num_decodes, out


class SpyreMLAMetadataBuilder(AttentionMetadataBuilder[SpyreMLAMetadata]):
    # vLLM orders the batch decodes first (one query token), as forward_impl expects
    reorder_batch_threshold: int = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SpyreMLAMetadata:
        m = common_attn_metadata
        return build_metadata(
            m.query_start_loc_cpu,
            m.seq_lens.cpu(),
            m.block_table_tensor.cpu(),
            m.slot_mapping[: m.num_actual_tokens].cpu(),
            self.block_size,
        )


def build_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> SpyreMLAMetadata:
    """One step's metadata from vLLM's host tensors (``slots``: the cache slot
    of each of the step's tokens); the index tensors moved to the card once."""
    num_decodes, groups = build_groups(query_start_loc, seq_lens, block_table, block_size)
    card = [LatentGroup(**{k: _to_card(v) for k, v in g.items()}) for g in groups]
    decode = card.pop(0) if num_decodes else None
    return SpyreMLAMetadata(
        num_actual_tokens=slots.shape[0],
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,  # one token each
        num_prefills=seq_lens.shape[0] - num_decodes,
        slots=slots.to(torch.int64).to(SPYRE),
        decode=decode,
        prefill=card.pop(0) if card else None,
    )


def _to_card(v: object) -> object:
    return v.to(SPYRE) if isinstance(v, torch.Tensor) else v


def step_metadata() -> SpyreMLAMetadata:
    """This step's MLA metadata from vLLM's forward context: every MLA layer
    has the same cache spec, so one builder and one metadata object."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    found = {id(m): m for m in _values(meta) if isinstance(m, SpyreMLAMetadata)}
    if len(found) != 1:
        raise RuntimeError(f"spyre MLA: expected one MLA metadata in the step, got {len(found)}")
    return next(iter(found.values()))


def _values(meta: object) -> list[object]:
    if isinstance(meta, dict):
        return list(meta.values())
    if isinstance(meta, list):
        return [v for d in meta for v in _values(d)]
    return [meta]


class SpyreMLAImpl(MLAAttentionImpl[SpyreMLAMetadata]):
    # forward_impl's distributed (DCP/PCP) paths are off: one card's heads
    dcp_world_size: int = 1
    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: torch.nn.Module,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
        **unsupported_args: object,
    ) -> None:
        bad = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto",
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
            "sparse MLA (indexer)": indexer is not None,
            **{name: True for name, v in unsupported_args.items() if v is not None},
        }
        names = [name for name, is_set in bad.items() if is_set]
        if names:
            raise NotImplementedError(f"spyre MLA does not support: {', '.join(names)}")
        self.num_heads = num_heads
        self.head_size = head_size  # kv_lora_rank + qk_rope_head_dim: the cache row
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        self.q_pad_num_heads = q_pad_num_heads

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """The step's latent rows ``[kv_c | k_pe]`` into their cache slots (the
        builder's card copy of the slot mapping; a compiled bucket's padding
        rows are not written)."""
        if kv_cache.numel() == 0:
            return
        meta = step_metadata()
        n = meta.num_actual_tokens
        rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, self.qk_rope_head_dim)], dim=-1)
        kv_cache.view(-1, self.head_size).index_copy_(0, meta.slots, rows.to(kv_cache.dtype))

    def _latent(self, kv_cache: torch.Tensor, g: LatentGroup) -> torch.Tensor:
        """The group's context rows gathered from the cache: [R, S, latent]."""
        rows = kv_cache.view(-1, self.head_size).index_select(0, g.kv_index)
        return rows.view(g.num_reqs, g.max_seq_len, self.head_size)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: SpyreMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode in the absorbed form: q ``[B, N, kv_lora_rank + rope]`` (already
        through W_UK) over each request's latent rows; returns the attention
        output in latent space ``[B, N, kv_lora_rank]`` (forward_impl applies W_UV)."""
        g = attn_metadata.decode
        assert g is not None and g.max_query_len == 1
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        r, h, d = g.num_reqs, self.num_heads, self.head_size
        assert q.shape[0] == r  # token i is decode request i (decodes first)
        latent = self._latent(kv_c_and_k_pe_cache, g).view(r, 1, g.max_seq_len, d)
        # one key head; its values are the same rows: lanes [0, kv_lora_rank) of
        # the output are softmax(q K^T) kv_c (the rope lanes are dropped)
        o = F.scaled_dot_product_attention(
            q.reshape(r, h, 1, d), latent, latent, attn_mask=g.mask, scale=self.scale,
            enable_gqa=h > 1,
        )  # fmt: skip
        return o[:, :, 0, : self.kv_lora_rank].contiguous(), None

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: SpyreMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """Prefill (and chunked prefill, prefix-cache hits): the requests' latent
        contexts up-projected to per-head keys and values for this step, causal
        attention after the cached context.  ``q`` [Tp, N, qk_head_dim], ``output``
        [Tp, N * v_head_dim] (the step's non-decode tokens)."""
        if output_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on spyre")
        g = attn_metadata.prefill
        assert g is not None
        r, qn, s = g.num_reqs, g.max_query_len, g.max_seq_len
        h, nope, rope, vd = (
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        latent = self._latent(kv_c_and_k_pe_cache, g).view(r * s, self.head_size)
        kv_c = latent[:, : self.kv_lora_rank].contiguous()
        kv = self.kv_b_proj(kv_c)[0].view(r, s, h, nope + vd)
        k_nope, v = kv.split([nope, vd], dim=-1)
        k_rope = latent[:, self.kv_lora_rank :].reshape(r, s, 1, rope).expand(r, s, h, rope)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)  # [R, N, S, qk]
        qq = q.index_select(0, g.q_index).view(r, qn, h, nope + rope).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qq, k, v.transpose(1, 2), attn_mask=g.mask, scale=self.scale
        )  # [R, N, Q, V]
        o = o.transpose(1, 2).reshape(r * qn, h * vd)
        output.copy_(o.index_select(0, g.out_index).to(output.dtype))


class SpyreMLAPrefillBackend(MLAPrefillBackend):
    """What the platform names as the MLA prefill backend
    (``Platform.get_mla_prefill_backend_cls``), so that vLLM's ``MLAAttention``
    does not select a GPU prefill kernel (flash-attn) when it is built.

    vLLM's prefill backends attend over the new tokens and, separately, over
    chunks of the cached context, merging by log-sum-exp; on the card
    ``SpyreMLAImpl.forward_mha`` attends over the whole paged latent context
    in one call instead, and never calls these two methods."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "SPYRE_MLA_PREFILL"

    def run_prefill_new_tokens(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(_NOT_CALLED)

    def run_prefill_context_chunk(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(_NOT_CALLED)


_NOT_CALLED = "spyre MLA prefill runs in SpyreMLAImpl.forward_mha (the whole paged context)"

BACKEND_QUALNAME = f"{SpyreMLABackend.__module__}.{SpyreMLABackend.__qualname__}"
