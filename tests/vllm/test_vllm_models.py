"""Model classes beyond llama on spyre through vLLM: sliding-window attention
(mistral, gemma3's local layers), soft-capped logits (gemma2), mixtures of
experts (mixtral, qwen3_moe: vLLM's FusedMoE on the card), compiled, with
greedy tokens equal to transformers on the CPU.

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
}


@pytest.mark.slow  # one compiled model each (~25 s)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_model_class_greedy_equals_cpu(arch, tmp_path, hf_greedy):
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    ref.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, kv_cache_memory_bytes=8 << 20, seed=0,
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
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
