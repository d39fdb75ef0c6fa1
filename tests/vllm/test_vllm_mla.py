"""DeepSeek-V3 latent attention (MLA) served from the latent cache on the card
(vllm_plugin/mla.py): greedy tokens equal to transformers on the CPU, the KV
cache one ``kv_lora_rank + qk_rope_head_dim`` row per token and layer (not
per-head keys and values), decode in the absorbed form, no host fallback.

fp32: tiny random models' greedy choices are close calls that 16-bit rounding
flips; fp32 must match token for token."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

import torch_spyre

# 4 heads, qk_nope 32 + rope 32 (qk_head_dim 64), v_head_dim 32, latent 32 + 32
KV_LORA, ROPE, NOPE, V_DIM, HEADS, LAYERS = 32, 32, 32, 32, 4, 2


def _config() -> transformers.DeepseekV3Config:
    """MoE (4 routed experts top-2, a shared expert, sigmoid router with the
    correction bias: the real checkpoint's ``noaux_tc``) after one dense layer.
    ``q_lora_rank`` 64: vLLM's fused ``[q_c | kv_c | k_pe]`` projection is then
    split at whole fp32 sticks (32 lanes), as the real checkpoint's 1536/512/64
    are; a rank of 48 leaves ``k_pe`` mid-stick and the compiled rotary matmul
    on it runs as its eager card kernel."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=256,
        initializer_range=0.2, moe_intermediate_size=64, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=KV_LORA, q_lora_rank=64, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM,
    )  # fmt: skip
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    return cfg


def _serve(tmp_path, hf_greedy, lengths, max_tokens, check=None, **llm_kwargs) -> None:
    """Prompts of ``lengths`` tokens submitted together, ``max_tokens`` greedy
    tokens each, then one that hits the prefix cache: equal to transformers on
    the CPU, no host fallback."""
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config()).eval()
    ref.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, kv_cache_memory_bytes=4 << 20, seed=0, **llm_kwargs,
    )  # fmt: skip
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        torch_spyre.reset_fallback_counts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert torch_spyre.fallback_counts() == {}
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, max_tokens), p
        if check is not None:
            check(llm)
        # a prompt that shares the longest one's first block (16 tokens): a
        # prefix-cache hit, prefilled over the cached latent rows
        again = [*prompts[-1][:20], 1, 2, 3, 4, 5]
        (o,) = llm.generate(
            [{"prompt_token_ids": again}],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert o.num_cached_tokens == 16, o.num_cached_tokens
        assert list(o.outputs[0].token_ids) == hf_greedy(ref, again, 4)
        assert torch_spyre.fallback_counts() == {}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def _latent_cache(llm) -> None:
    """Every layer's cache is a card tensor of one latent row per token; the
    layers attend through the spyre MLA backend, prefill's prefill backend included."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from torch_spyre.vllm_plugin.mla import SpyreMLAImpl, SpyreMLAPrefillBackend

    runner = _runner(llm)
    caches = list(runner.kv_caches)
    assert len(caches) == LAYERS
    latent = KV_LORA + ROPE
    for kv in caches:
        assert kv.device.type == "spyre" and kv.dtype == torch.float32
        blocks, _, block_size, row = kv.shape
        assert row == latent
        # bytes per token and layer: the latent row, 64 x 4 B = 256 B; the expanded
        # form would hold 4 heads x (64 + 32) = 384 values, 1536 B (6x)
        assert kv.numel() * kv.element_size() // (blocks * block_size) == latent * 4
        # 4 MiB of cache: 512 B per token over both layers, 8192 tokens (the
        # expanded form's 4096 B: 1024, test_mla_disable_serves_expanded)
        assert blocks * block_size == (4 << 20) // 512 == 8192
    per_token = sum(kv.numel() * kv.element_size() // kv.shape[0] // kv.shape[2] for kv in caches)
    assert per_token == latent * 4 * LAYERS == 512
    expanded = HEADS * (NOPE + ROPE + V_DIM) * 4 * LAYERS
    assert expanded == 3072 and expanded // per_token == 6
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == LAYERS
    for m in layers:
        assert isinstance(m.impl, SpyreMLAImpl)
        assert isinstance(m.prefill_backend, SpyreMLAPrefillBackend)
        assert m.W_UK_T.device.type == "spyre" and m.W_UV.device.type == "spyre"


def _recording(monkeypatch):
    """Counts the decode (absorbed) and prefill (up-projected) calls of the impl."""
    from torch_spyre.vllm_plugin.mla import SpyreMLAImpl

    calls = {"mqa": 0, "mha": 0}
    mqa, mha = SpyreMLAImpl.forward_mqa, SpyreMLAImpl.forward_mha

    def forward_mqa(self, *a, **k):
        calls["mqa"] += 1
        return mqa(self, *a, **k)

    def forward_mha(self, *a, **k):
        calls["mha"] += 1
        return mha(self, *a, **k)

    monkeypatch.setattr(SpyreMLAImpl, "forward_mqa", forward_mqa)
    monkeypatch.setattr(SpyreMLAImpl, "forward_mha", forward_mha)
    return calls


@pytest.mark.slow  # eager, ~21 s
def test_latent_cache_eager_greedy_equals_cpu(tmp_path, hf_greedy, monkeypatch):
    """3 prompts of 5, 12 and 23 tokens, 14 tokens each (the 23-token prompt's
    decodes cross the block boundaries at 32; 16-token blocks), eager layers."""
    calls = _recording(monkeypatch)
    _serve(tmp_path, hf_greedy, (5, 12, 23), 14, check=_latent_cache, enforce_eager=True)
    assert calls["mqa"] > 0 and calls["mha"] > 0, calls


@pytest.mark.slow  # compiled, ~36 s (13 s with Inductor's cache warm)
def test_latent_cache_compiled_chunked_prefill(tmp_path, hf_greedy, monkeypatch, spyre_settings):
    """Compiled forward (the MLA ops opaque in the graph; every other op a
    kernel program: TORCH_SPYRE_COMPILE_FALLBACK=error), a 16-token step
    budget: the 23- and 40-token prompts are prefilled in chunks over their
    cached latent context, next to decodes in the same steps."""
    spyre_settings(compile_fallback="error")
    calls = _recording(monkeypatch)
    _serve(tmp_path, hf_greedy, (3, 23, 40), 10, check=_latent_cache, max_num_batched_tokens=16)
    assert calls["mqa"] > 0 and calls["mha"] > 0, calls


@pytest.mark.slow  # eager, ~11-18 s
def test_mla_disable_serves_expanded(tmp_path, hf_greedy, monkeypatch):
    """``VLLM_MLA_DISABLE=1`` (vLLM's switch): the expanded multi-head form over
    the paged K/V cache (attention.py), the same tokens."""
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")

    def expanded(llm) -> None:
        caches = list(_runner(llm).kv_caches)
        # [k/v, block, token, kv_head, head]: V padded to the QK head size
        assert caches[0].dim() == 5 and tuple(caches[0].shape[-2:]) == (HEADS, NOPE + ROPE)
        _, blocks, block_size, _, _ = caches[0].shape
        # 2 x 4 heads x 64 x 4 B = 2048 B per token and layer: 1024 tokens in 4 MiB
        assert blocks * block_size == (4 << 20) // (2 * 2048) == 1024

    _serve(tmp_path, hf_greedy, (5, 23), 6, check=expanded, enforce_eager=True)


def test_platform_picks_the_latent_backend() -> None:
    """MLA on spyre is the latent backend (sparse MLA is refused), and the
    platform plugin no longer turns MLA off."""
    import os

    from vllm.v1.attention.selector import AttentionSelectorConfig

    from torch_spyre.vllm_plugin import PLATFORM_QUALNAME, mla, register
    from torch_spyre.vllm_plugin.platform import SpyrePlatform

    before = os.environ.pop("VLLM_MLA_DISABLE", None)
    try:
        assert register() == PLATFORM_QUALNAME  # IBM's plugin is not installed here
        assert "VLLM_MLA_DISABLE" not in os.environ  # was set to 1 before the latent cache
    finally:
        if before is not None:
            os.environ["VLLM_MLA_DISABLE"] = before
    cfg = AttentionSelectorConfig(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16, use_mla=True
    )
    assert SpyrePlatform.get_attn_backend_cls(None, cfg) == mla.BACKEND_QUALNAME
    sparse = AttentionSelectorConfig(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16, use_mla=True,
        use_sparse=True,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="sparse"):
        SpyrePlatform.get_attn_backend_cls(None, sparse)


def test_groups_index_each_paths_slice() -> None:
    """Host indices of a mixed step (2 decodes first, then prefills of 3 and 2
    tokens after 4 and 0 cached): each group's query and output rows count from
    its own first token, as forward_impl slices the step."""
    from torch_spyre.vllm_plugin.mla import build_groups

    qsl = torch.tensor([0, 1, 2, 5, 7])
    seq = torch.tensor([9, 17, 7, 2])
    table = torch.arange(4 * 3).view(4, 3)
    nd, (dec, pre) = build_groups(qsl, seq, table, 16)
    assert nd == 2
    assert dec["q_index"].tolist() == [0, 1] and dec["out_index"].tolist() == [0, 1]
    assert dec["max_seq_len"] == 32  # whole pages
    # request 1's 17th position is in its second block (table row [3, 4, 5]): slot 4*16+0
    assert dec["kv_index"].view(2, 32)[1, 16].item() == 4 * 16
    assert pre["max_query_len"] == 3 and pre["q_index"].tolist() == [0, 1, 2, 3, 4, 0]
    assert pre["out_index"].tolist() == [0, 1, 2, 3, 4]
    mask = pre["mask"][:, 0]
    # the first prefill's queries sit after 4 cached positions: query 0 sees 0..4
    assert mask[0, 0, :7].tolist() == [True] * 5 + [False] * 2
    with pytest.raises(RuntimeError, match="decodes first"):
        build_groups(torch.tensor([0, 3, 4]), torch.tensor([3, 5]), table[:2], 16)


class _UpProj(torch.nn.Module):
    """``kv_b_proj`` as vLLM's linear layers are called: ``(x @ W^T, bias)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


def test_impl_absorbed_decode_and_prefill_equal_expanded() -> None:
    """The card side of the backend on spyre tensors against the expanded form
    on the CPU: a decode (20 positions of context, across a block boundary)
    in the absorbed form (``q_nope`` through W_UK, attention over latent rows,
    out through W_UV, as vLLM's forward_impl chains them) and a prefill of 5
    tokens after 3 cached ones (up-projected from the latent)."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.attention.backend import AttentionType

    from torch_spyre.vllm_plugin.mla import SpyreMLAImpl, build_metadata

    g = torch.Generator().manual_seed(0)
    block, latent, qk = 16, KV_LORA + ROPE, NOPE + ROPE
    w = torch.randn(HEADS * (NOPE + V_DIM), KV_LORA, generator=g) * 0.2
    impl = SpyreMLAImpl(
        num_heads=HEADS, head_size=latent, scale=qk**-0.5, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
        attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, qk_head_dim=qk,
        v_head_dim=V_DIM, kv_b_proj=_UpProj(w.to("spyre")),
    )  # fmt: skip
    # request 0: a decode at position 19; request 1: 5 new tokens after 3 cached
    seq = torch.tensor([20, 8])
    table = torch.tensor([[3, 0], [1, 2]])
    rows = [torch.randn(int(n), latent, generator=g) for n in seq]
    cache = torch.zeros(4, 1, block, latent)
    slot_of = [[int(table[r, p // block]) * block + p % block for p in range(int(n))] for r, n in enumerate(seq)]  # fmt: skip
    for r in range(2):
        cache.view(-1, latent)[slot_of[r]] = rows[r]
    step_slots = torch.tensor([slot_of[0][19], *slot_of[1][3:]])
    meta = build_metadata(torch.tensor([0, 1, 6]), seq, table, step_slots, block)
    assert (meta.num_decodes, meta.num_prefills, meta.num_actual_tokens) == (1, 1, 6)
    kv_cache = cache.to("spyre").squeeze(1)

    w_uk, w_uv = w.view(HEADS, NOPE + V_DIM, KV_LORA).split([NOPE, V_DIM], dim=1)

    def expanded(r: int, q: torch.Tensor) -> torch.Tensor:
        """Reference: per-head keys and values up-projected, causal after the context."""
        kv_c, k_pe = rows[r][:, :KV_LORA], rows[r][:, KV_LORA:]
        k = torch.cat([torch.einsum("sl,hnl->hsn", kv_c, w_uk), k_pe.expand(HEADS, -1, -1)], -1)
        v = torch.einsum("sl,hvl->hsv", kv_c, w_uv)
        t, s = q.shape[0], kv_c.shape[0]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=mask, scale=qk**-0.5
        )
        return o.transpose(0, 1)  # [T, H, V]

    q_dec = torch.randn(1, HEADS, qk, generator=g)
    q_pre = torch.randn(5, HEADS, qk, generator=g)
    torch_spyre.reset_fallback_counts()
    # decode: what forward_impl does around forward_mqa (W_UK_T [H, nope, L], W_UV [H, L, V])
    q_nope, q_pe = q_dec.to("spyre").split([NOPE, ROPE], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk.to("spyre")).transpose(0, 1)
    o_lat, lse = impl.forward_mqa((ql_nope, q_pe), kv_cache, meta, None)
    assert lse is None and tuple(o_lat.shape) == (1, HEADS, KV_LORA)
    o_dec = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2).to("spyre")).transpose(0, 1)
    # prefill
    out = torch.zeros(5, HEADS * V_DIM).to("spyre")
    impl.forward_mha(q_pre.to("spyre"), None, None, kv_cache, meta, None, out)
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(o_dec.cpu(), expanded(0, q_dec), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        out.cpu().view(5, HEADS, V_DIM), expanded(1, q_pre), rtol=1e-4, atol=1e-5
    )
    # the step's rows into their slots
    kv_c_new = torch.randn(6, KV_LORA, generator=g)
    k_pe_new = torch.randn(6, 1, ROPE, generator=g)
    # the metadata from vLLM's forward context, as a step holds it (one per layer)
    step = ForwardContext(
        no_compile_layers={}, attn_metadata={"a": meta, "b": meta}, slot_mapping={}
    )
    with override_forward_context(step):
        impl.do_kv_cache_update(
            kv_c_new.to("spyre"), k_pe_new.to("spyre"), kv_cache, None, "auto", None
        )
    written = kv_cache.cpu().reshape(-1, latent)[step_slots]
    assert torch.equal(written, torch.cat([kv_c_new, k_pe_new[:, 0]], dim=-1))
