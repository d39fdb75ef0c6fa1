"""Model classes beyond llama on spyre through vLLM: sliding-window attention
(mistral, gemma3's and gemma4's local layers), soft-capped logits (gemma2), mixtures of
experts (mixtral, qwen3_moe: vLLM's FusedMoE on the card), the Granite 4
hybrid (granitemoehybrid: Mamba-2 + attention + MoE, vLLM's hybrid KV cache
with the Mamba state on the card: vllm_plugin/mamba.py) and DeepSeek-V3
(shared expert, latent attention from the latent cache, interleaved rotary), compiled
(DeepSeek-V3 eager too), with greedy tokens equal to transformers on the CPU.

fp32 on the card: these are tiny random models whose greedy choices are close
calls, which 16-bit rounding flips (the same models in bf16 also serve; the
real-weight SmolLM2 runs in fp16 in test_vllm_generate.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

import torch_spyre

COMMON = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, head_dim=32,
)  # fmt: skip

CONFIGS = {
    # a window of 8: the 23-token prompt and 12 new tokens reach far past it
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        sliding_window=8,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        sliding_window=8,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=30.0,
        final_logit_softcapping=20.0,
    ),  # fmt: skip
    "gemma4_text": lambda: transformers.Gemma4TextConfig(
        **COMMON,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    # vLLM's FusedMoE (router top-k, then spyre::moe_experts: vllm_plugin/moe.py)
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2
    ),  # fmt: skip
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    ),  # fmt: skip
    # Granite 4: a Mamba-2 layer then an attention layer, MoE + shared MLP in both
    # (8 Mamba heads of 32 = mamba_expand * hidden, as transformers requires)
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **COMMON,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=128,
        layer_types=["mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
    ),  # fmt: skip
}


#: DeepSeek-V3 (MoE with a shared expert, sigmoid router with the correction
#: bias: the real checkpoint's topk_method / scoring_func), its latent
#: attention served from the latent cache (vllm_plugin/mla.py; the expanded
#: form with VLLM_MLA_DISABLE=1: test_vllm_mla.py), its interleaved (GPT-J)
#: rotary as a signed-permutation matmul (vllm_plugin/layers.py).  q_lora_rank
#: 64: the fused [q_c | kv_c | k_pe] projection splits at whole fp32 sticks.
def _deepseek_v3() -> transformers.PretrainedConfig:
    cfg = transformers.DeepseekV3Config(
        **{**COMMON, "head_dim": None, "num_key_value_heads": 4},
        moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
    )  # fmt: skip
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    return cfg


CONFIGS["deepseek_v3"] = _deepseek_v3


def _serve_greedy(arch, tmp_path, hf_greedy, inspect=None, **llm_kwargs) -> None:
    """3 prompts of 5, 12 and 23 tokens, 12 greedy tokens each, submitted
    together: equal to transformers on the CPU, no host fallback."""
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    make = CONFIGS[arch]
    ref = transformers.AutoModelForCausalLM.from_config(make()).eval()
    ref.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, kv_cache_memory_bytes=8 << 20, seed=0, **llm_kwargs,
    )  # fmt: skip
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 23)]
        torch_spyre.reset_fallback_counts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert torch_spyre.fallback_counts() == {}
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, 12), (arch, p)
        if inspect is not None:
            inspect(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.slow  # one compiled model each (~25 s)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_model_class_greedy_equals_cpu(arch, tmp_path, hf_greedy):
    _serve_greedy(arch, tmp_path, hf_greedy)


@pytest.mark.slow  # eager, ~15 s
def test_deepseek_v3_eager_greedy_equals_cpu(tmp_path, hf_greedy):
    from torch_spyre.runtime import dispatch_stats

    before = dispatch_stats.counts("kernel").get("moe_experts", 0)
    _serve_greedy("deepseek_v3", tmp_path, hf_greedy, enforce_eager=True)
    assert dispatch_stats.counts("kernel").get("moe_experts", 0) > before  # routed on the card


@pytest.mark.slow  # eager, ~15 s
def test_granitemoehybrid_eager_chunked_prefill(tmp_path, hf_greedy, monkeypatch):
    """Eager layers, a 16-token step budget: the 12- and 23-token prompts are
    prefilled in chunks, continuing their Mamba conv and SSM state from the
    previous step while the other requests decode in the same step."""
    from torch_spyre.vllm_plugin import mamba

    steps: list[tuple[int, int, list[float]]] = []
    build = mamba.build_indices

    def recording(meta, conv_len, dtype):
        idx = build(meta, conv_len, dtype)
        init = [] if idx.init_p is None else idx.init_p.cpu().tolist()
        steps.append((idx.num_decodes, idx.num_prefills, init))
        return idx

    # the engine core runs in this process (no multiprocessing in these tests)
    monkeypatch.setattr(mamba, "build_indices", recording)
    _serve_greedy(
        "granitemoehybrid", tmp_path, hf_greedy, inspect=_mamba_on_the_card,
        enforce_eager=True, max_num_batched_tokens=16,
    )  # fmt: skip
    assert any(d and p for d, p, _ in steps), steps  # decodes and prefills in one step
    assert any(1.0 in init for _, _, init in steps), steps  # a prefill continuing a state


def _mamba_on_the_card(llm) -> None:
    """The Mamba layer ran the card's programs (not their host references), and
    the card tensors of the hybrid cache (paged KV + Mamba states) take
    kv_cache_memory_bytes (8 MiB, to a block), not vLLM's shared-buffer estimate."""
    from torch_spyre.runtime import dispatch_stats
    from torch_spyre.vllm_plugin.mamba import SpyreMambaMixer2
    from torch_spyre.vllm_plugin.model_runner import _device_bytes

    ran = dispatch_stats.counts("kernel")
    for op in ("ssd_chunk_scan", "ssm_step", "rmsnorm_gated", "convolution_overrideable.default"):
        assert ran.get(op, 0) > 0, (op, sorted(ran))

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    runner = runner.model_runner
    tensors = list(runner.kv_caches)
    for m in runner.model.modules():
        if isinstance(m, SpyreMambaMixer2):
            assert all(t.device.type == "spyre" for t in m.kv_cache)
            tensors += list(m.kv_cache)
    assert len(tensors) == 3  # one attention layer's pages, one Mamba layer's conv + ssm
    used = sum(_device_bytes(t) for t in tensors)
    assert 0.8 * (8 << 20) <= used <= 1.01 * (8 << 20), used  # was 2.5x before scaling
