"""MPNet (all-mpnet-base-v2 and other sentence-transformers MPNet embedders) for vLLM.

vLLM has no MPNet model; this registers one (``vllm_plugin.register_ops``,
``ModelRegistry.register_model``, vLLM's public hook for out-of-tree models)
for the pooling runner: ``LLM(..., runner="pooling").embed`` and
``vllm serve --runner pooling`` with ``/v1/embeddings``.

MPNet is a BERT-shaped encoder with two differences: positions start after the
padding index (``padding_idx + 1``), and every layer adds a learned relative
position bias (one value per head per bucket of key - query distance) to its
attention scores.  The bias reaches the spyre attention backend through
``spyre_position_bias`` on the attention layer (vllm_plugin/attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import EncoderOnlyAttention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.bert import BertIntermediate, BertOutput
from vllm.model_executor.models.interfaces_base import default_pooling_type
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

PADDING_IDX = 1  # MPNet's (HF MPNetEmbeddings.padding_idx)


def relative_position_bucket(
    relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """MPNet's bucketing of key - query distances (HF MPNetEncoder's, as is)."""
    ret = 0
    n = -relative_position
    num_buckets //= 2
    ret += (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    return ret + torch.where(is_small, n, val_if_large)


class MPNetEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = VocabParallelEmbedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # HF numbers real tokens from padding_idx + 1 (create_position_ids_from_input_ids)
        pos = self.position_embeddings(positions + (PADDING_IDX + 1))
        return self.LayerNorm(self.word_embeddings(input_ids) + pos)


class MPNetSelfAttention(nn.Module):
    def __init__(self, config, bias: nn.Embedding, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_heads,
            bias=True,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o = RowParallelLinear(
            config.hidden_size, config.hidden_size, bias=True, prefix=f"{prefix}.o"
        )
        self.attn = EncoderOnlyAttention(
            num_heads=self.num_heads,
            head_size=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.num_heads,
            prefix=f"{prefix}.attn",
        )
        buckets = config.relative_attention_num_buckets

        def position_bias(rel: torch.Tensor) -> torch.Tensor:
            """[H, Q, S] bias for key - query distances ``rel`` [Q, S] (host ints)."""
            idx = relative_position_bucket(rel, num_buckets=buckets)
            w = bias.weight  # [buckets, H], shared by all layers
            return torch.nn.functional.embedding(idx.to(w.device), w).permute(2, 0, 1)

        self.attn.spyre_position_bias = position_bias

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        size = self.num_heads * self.head_dim
        q, k, v = qkv.split([size, size, size], dim=-1)
        out, _ = self.o(self.attn(q, k, v))
        return out


class MPNetLayer(nn.Module):
    def __init__(self, config, bias: nn.Embedding, prefix: str) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.attn = MPNetSelfAttention(config, bias, f"{prefix}.attention.attn")
        self.attention.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = BertIntermediate(
            config.hidden_size, config.intermediate_size, config.hidden_act,
            prefix=f"{prefix}.intermediate",
        )  # fmt: skip
        self.output = BertOutput(
            config.hidden_size, config.intermediate_size, config.layer_norm_eps,
            prefix=f"{prefix}.output",
        )  # fmt: skip

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.attention.LayerNorm(self.attention.attn(hidden_states) + hidden_states)
        return self.output(self.intermediate(attn), attn)


class MPNetModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embeddings = MPNetEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.relative_attention_bias = nn.Embedding(
            config.relative_attention_num_buckets, config.num_attention_heads
        )
        bias = self.encoder.relative_attention_bias
        self.encoder.layer = nn.ModuleList(
            MPNetLayer(config, bias, f"{prefix}.encoder.layer.{i}")
            for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            h = layer(h)
        return h


@default_pooling_type(seq_pooling_type="MEAN")
class MPNetEmbeddingModel(nn.Module):
    """MPNet with vLLM's embedding pooler (mean pooling and normalisation as the
    sentence-transformers config says)."""

    is_pooling_model = True
    packed_modules_mapping = {"qkv_proj": ["q", "k", "v"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        pooler_config = vllm_config.model_config.pooler_config
        assert pooler_config is not None
        self.model = MPNetModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.pooler = DispatchPooler.for_embedding(pooler_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings.word_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError("MPNet on spyre takes token ids, not embeddings")
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapper = WeightsMapper(
            orig_to_new_prefix={"mpnet.": "model.", "lm_head.": None, "pooler.": None},
            orig_to_new_stacked={
                ".attn.q.": (".attn.qkv_proj.", "q"),
                ".attn.k.": (".attn.qkv_proj.", "k"),
                ".attn.v.": (".attn.qkv_proj.", "v"),
            },
        )
        weights = [
            (n if n.startswith(("mpnet.", "lm_head.", "pooler.")) else "model." + n, w)
            for n, w in weights
            if not n.endswith("position_ids")
        ]
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)
