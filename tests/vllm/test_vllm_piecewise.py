"""vLLM's forward compiled piece by piece between attention ops, each distinct
piece once (``compiler/piecewise.py``, ``TORCH_SPYRE_VLLM_PIECEWISE``): the
same tokens and the same modelled time as the whole graph, with the middle
pieces of identical layers compiled once."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = 5


@pytest.fixture(scope="module")
def five_layer_llama(tmp_path_factory) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("five_layer_llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def _state(worker) -> dict:
    return worker.model_runner.compiled.summary()


def _run(path: str, prompts: list[list[int]]):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=8 << 20, seed=0,
    )  # fmt: skip
    try:
        clock = torch.spyre.modelled_time_s()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        modelled = torch.spyre.modelled_time_s() - clock
        summary = llm.collective_rpc(_state)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], modelled, summary


def test_identical_layers_compile_once_with_the_same_tokens_and_time(
    five_layer_llama, spyre_settings, hf_greedy
):
    from torch_spyre.compiler import piecewise

    spyre_settings(vllm_piecewise=True)
    piecewise.clear()  # pieces another engine of this process compiled would be reused
    ref = LlamaForCausalLM.from_pretrained(five_layer_llama, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11)]
    tokens, modelled, summary = _run(five_layer_llama, prompts)
    for p, t in zip(prompts, tokens):
        assert t == hf_greedy(ref, p, 6), p
    # per bucket (16, 32): the head (embedding to layer 0's attention), the
    # middle (one layer's attention output to the next one's), the tail; the
    # middle of the other layers reuses the first one's code
    buckets = len(summary["buckets"])
    # Dynamo traced the forward once for every bucket, the layers as one
    # region (compiler/regions.py); each bucket compiled for its own shapes
    assert summary["traces"] == 1 and summary["regions"] == ["model.layers"]
    assert summary["pieces"] == {
        "pieces": buckets * (LAYERS + 1),
        "compiled": buckets * 3,
        "reused": buckets * (LAYERS - 2),
    }
    # each piece compiled goes through AOTAutograd's cache (a warm start loads
    # it): compiled outside the fake mode, its constants are real tensors
    cache = summary["aot_cache"]
    assert not cache.get("bypass") and sum(cache.values()) == 3 * buckets, cache

    spyre_settings(vllm_piecewise=False)
    whole_tokens, whole_modelled, whole = _run(five_layer_llama, prompts)
    assert whole["pieces"]["pieces"] == 0 and whole["graphs"] == buckets
    assert whole_tokens == tokens
    # never slower on the card: the cut is at the attention ops, fusion
    # barriers (fallback kernels) in the whole graph too, and the layers'
    # rotary lookups are shared across pieces as the whole graph shares them
    assert modelled <= whole_modelled * (1 + 1e-9), (modelled, whole_modelled)

    # traced flat, every layer and every bucket (TORCH_SPYRE_VLLM_REGIONS=0):
    # the same programs, so the same tokens and the same modelled time
    spyre_settings(vllm_piecewise=True, vllm_regions=False)
    piecewise.clear()
    flat_tokens, flat_modelled, flat = _run(five_layer_llama, prompts)
    assert flat["traces"] == buckets and flat["regions"] == []
    assert flat["pieces"] == summary["pieces"]
    assert flat_tokens == tokens
    assert flat_modelled == pytest.approx(modelled, rel=1e-12)
