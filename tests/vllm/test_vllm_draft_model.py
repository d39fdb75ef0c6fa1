"""Draft-model speculative decoding on spyre (vllm_plugin/drafter.py, draft_kernels.py).

The target is the tests' tiny random llama (2 layers); the draft is the same
weights truncated to its first layer (so its guesses are sometimes the
target's: acceptance above zero). Both run on the card in fp32: the target
compiled per bucket, the draft eagerly; their weights and paged KV caches in
device memory; no host fallback. Greedy output with speculation is token for
token the output without it (and transformers' on the CPU) for a batch of
prompts of different lengths, and vLLM's counters show accepted drafts.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

import torch_spyre

PROMPTS = [[5, 6, 7, 8] * 6, [1, 2, 3, 9, 11], list(range(30, 70))]  # 24, 5, 40 tokens
N_TOKENS = 16


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir: str, tmp_path_factory) -> str:
    """The target's first layer, embedding, final norm and LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_llama_dir)
    full = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    cfg.num_hidden_layers = 1
    draft = LlamaForCausalLM(cfg).eval()
    state = {k: v for k, v in full.state_dict().items() if ".layers.1." not in k}
    draft.load_state_dict(state)
    path = tmp_path_factory.mktemp("tiny_llama_draft")
    draft.save_pretrained(path)
    assert json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"] == 1
    return str(path)


def _placement(worker) -> dict:
    """Where the drafter's weights and KV cache live, and what ran."""
    r = worker.model_runner
    d = r.drafter
    ctx = r.compilation_config.static_forward_context
    names = sorted(d._draft_attn_layer_names)
    return {
        "drafter": type(d).__name__,
        "weights": {p.device.type for p in d.model.parameters()},
        "draft_layers": names,
        "draft_kv": {ctx[n].kv_cache.device.type for n in names},
        "kv_layers": len({t.data_ptr() for t in r.kv_caches}),
        "compiled": r.compiled is not None,
    }


def _generate(path: str, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,  # buckets 16, 32, 64
        kv_cache_memory_bytes=8 << 20,
        seed=0,
        disable_log_stats=False,  # vLLM's spec-decode counters
        speculative_config=spec,
    )
    try:
        torch_spyre.reset_fallback_counts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        fallbacks = torch_spyre.fallback_counts()
        counters = {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
        }
        placement = llm.collective_rpc(_placement)[0] if spec else None
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "fallbacks": fallbacks,
        "counters": counters,
        "placement": placement,
    }


@pytest.mark.slow
def test_draft_model_greedy_equals_no_speculation(
    tiny_llama_dir, draft_dir, tiny_llama_ref, hf_greedy
):
    want = [hf_greedy(tiny_llama_ref, p, N_TOKENS) for p in PROMPTS]
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    got = _generate(tiny_llama_dir, spec)
    base = _generate(tiny_llama_dir, None)
    assert base["tokens"] == want
    for p, w, g in zip(PROMPTS, base["tokens"], got["tokens"]):
        assert g == w, len(p)
    c = got["counters"]
    assert c["vllm:spec_decode_num_draft_tokens"] > 0
    assert c["vllm:spec_decode_num_accepted_tokens"] > 0
    pl = got["placement"]
    assert pl["drafter"] == "DraftModelProposer" and pl["compiled"]
    assert pl["weights"] == {"spyre"}
    assert pl["draft_layers"] and pl["draft_kv"] == {"spyre"}
    assert pl["kv_layers"] == 3  # the target's 2 attention layers + the draft's 1
    assert got["fallbacks"] == {}
