"""Model-based speculative decoding on spyre: draft models, EAGLE / EAGLE-3
heads and MTP layers (vllm_plugin/drafter.py, draft_kernels.py).

* draft model: the target is the tests' tiny random llama (2 layers); the
  draft is the same weights truncated to its first layer (so its guesses are
  sometimes the target's: acceptance above zero);
* EAGLE: vLLM's ``EagleLlamaForCausalLM`` from a tiny EAGLE checkpoint (one
  decoder layer and ``fc``, the target's embedding and LM head shared) over a
  one-layer tiny llama. The head is the target's own layer with ``fc`` passing
  the next token's embedding through, and the target's attention output is
  damped (``o_proj`` x 0.02), so the head's guess is often the target's next
  token: acceptance above zero while attention still decides some tokens;
* EAGLE-3: vLLM's ``Eagle3LlamaForCausalLM`` from a tiny random EAGLE-3
  checkpoint over the 2-layer tiny llama, fed the target's embeddings and
  both layers' outputs (``eagle_aux_hidden_state_layer_ids`` [0, 1, 2]: the
  compiled target forward returns them beside its hidden states). A random
  head's drafts are rejected; the test checks the tokens, that drafts were
  made and where everything ran;
* MTP: a tiny DeepSeek-V3 (MoE, latent attention in its expanded form) with
  one multi-token-prediction layer (``num_nextn_predict_layers=1``, vLLM's
  ``DeepSeekMTP``), random weights (vLLM's dummy loader: transformers saves
  no MTP layer), so the check is the tokens against the same model without
  speculation, that drafts were made, and where everything ran.

Target and drafter run on the card in fp32: the target compiled per bucket,
the drafter eagerly; their weights and paged KV caches in device memory; no
host fallback. Greedy output with speculation is token for token the output
without it (and, but for MTP, transformers' on the CPU) for a batch of
prompts of different lengths; vLLM's counters show drafts made, and
accepted for the draft model and EAGLE. Random sampling with probabilistic
drafts runs through vLLM's rejection sampling.
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


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory) -> tuple[str, str]:
    """(a one-layer tiny llama, an EAGLE head for it): see the module docstring."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.model.layers[0].self_attn.o_proj.weight.mul_(0.02)
    target_dir = tmp_path_factory.mktemp("tiny_llama_1l")
    target.save_pretrained(target_dir)
    # EAGLE checkpoint names: "layers.0....", "fc.weight" (no input_layernorm:
    # vLLM's EAGLE layer 0 has none; no embedding / LM head: the target's)
    head = {
        k.removeprefix("model."): v.clone()
        for k, v in target.state_dict().items()
        if k.startswith("model.layers.0.") and "input_layernorm" not in k
    }
    h = cfg.hidden_size
    head["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)  # [embed, hidden]
    eagle_dir = tmp_path_factory.mktemp("tiny_eagle")
    save_file(head, str(eagle_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(eagle_dir)
    return str(target_dir), str(eagle_dir)


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory) -> str:
    """A random EAGLE-3 head (one ``midlayer``, ``fc`` over 3 target layers'
    states) for the tests' tiny llama, in EAGLE-3 checkpoint names."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(2)
    h, inter, kv = 128, 256, 64  # kv: 2 heads x 32

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    head = {
        "midlayer.self_attn.q_proj.weight": r(h, 2 * h),  # [embeds, hidden] in
        "midlayer.self_attn.k_proj.weight": r(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, h),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "fc.weight": r(h, 3 * h),
        **{
            f"{n}.weight": torch.ones(h)
            for n in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                      "midlayer.post_attention_layernorm", "norm")
        },
    }  # fmt: skip
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=h, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    cfg.eagle_aux_hidden_state_layer_ids = [0, 1, 2]
    path = tmp_path_factory.mktemp("tiny_eagle3")
    save_file(head, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
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
        "aux_layers": tuple(getattr(r.model.model, "aux_hidden_state_layers", ())),
    }


def _generate(path: str, spec: dict | None, temperature: float = 0.0, **llm_kwargs) -> dict:
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
        **llm_kwargs,
    )
    try:
        torch_spyre.reset_fallback_counts()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=N_TOKENS, temperature=temperature, ignore_eos=True),
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
    if spec:
        print(
            f"\n{spec['method']}: drafted {counters.get('vllm:spec_decode_num_draft_tokens', 0):.0f}, "
            f"accepted {counters.get('vllm:spec_decode_num_accepted_tokens', 0):.0f}"
        )
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "fallbacks": fallbacks,
        "counters": counters,
        "placement": placement,
    }


def _assert_on_card(got: dict, drafter: str, kv_layers: int) -> None:
    """The drafter is vLLM's ``drafter``, compiled, its weights and KV cache on
    the card (``kv_layers`` attention layers in all), and nothing fell back."""
    pl = got["placement"]
    assert pl["drafter"] == drafter and pl["compiled"]
    assert pl["weights"] == {"spyre"}
    assert pl["draft_layers"] and pl["draft_kv"] == {"spyre"}
    assert pl["kv_layers"] == kv_layers
    assert got["fallbacks"] == {}


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
    # the target's 2 attention layers + the draft's 1
    _assert_on_card(got, "DraftModelProposer", kv_layers=3)


@pytest.mark.slow
def test_eagle_greedy_equals_no_speculation(eagle_pair, hf_greedy):
    from transformers import LlamaForCausalLM

    target_dir, eagle_dir = eagle_pair
    ref = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    want = [hf_greedy(ref, p, N_TOKENS) for p in PROMPTS]
    spec = {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 3}
    got = _generate(target_dir, spec)
    base = _generate(target_dir, None)
    assert base["tokens"] == want
    for p, w, g in zip(PROMPTS, base["tokens"], got["tokens"]):
        assert g == w, len(p)
    c = got["counters"]
    assert c["vllm:spec_decode_num_draft_tokens"] > 0
    assert c["vllm:spec_decode_num_accepted_tokens"] > 0
    # fc and the layer on the card (embedding and head are the target's); the
    # target's attention layer + the head's
    _assert_on_card(got, "EagleProposer", kv_layers=2)


@pytest.mark.slow
def test_eagle3_greedy_equals_no_speculation(tiny_llama_dir, eagle3_dir, tiny_llama_ref, hf_greedy):
    want = [hf_greedy(tiny_llama_ref, p, N_TOKENS) for p in PROMPTS]
    spec = {"method": "eagle3", "model": eagle3_dir, "num_speculative_tokens": 3}
    got = _generate(tiny_llama_dir, spec)
    for p, w, g in zip(PROMPTS, want, got["tokens"]):
        assert g == w, len(p)
    assert got["counters"]["vllm:spec_decode_num_draft_tokens"] > 0
    _assert_on_card(got, "EagleProposer", kv_layers=3)  # the target's 2 + the head's
    assert got["placement"]["aux_layers"] == (0, 1, 2)


@pytest.mark.slow
def test_mtp_greedy_equals_no_speculation(tmp_path):
    """DeepSeek's MTP layer: vLLM's ``@support_torch_compile`` model class
    calls ``forward`` past nn.Module hooks; the drafter's inputs still reach
    the card (drafter.py wraps ``forward``)."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
    )  # fmt: skip
    cfg.topk_method, cfg.scoring_func = "noaux_tc", "sigmoid"
    cfg.num_nextn_predict_layers = 1
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    path = str(tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    got = _generate(path, spec, load_format="dummy")
    base = _generate(path, None, load_format="dummy")
    for p, w, g in zip(PROMPTS, base["tokens"], got["tokens"]):
        assert g == w, len(p)
    assert got["counters"]["vllm:spec_decode_num_draft_tokens"] > 0
    _assert_on_card(got, "EagleProposer", kv_layers=3)  # the target's 2 + the MTP layer's


@pytest.mark.slow
def test_draft_model_random_sampling(tiny_llama_dir, draft_dir):
    """temperature > 0 with probabilistic drafts: vLLM's rejection sampling
    with the draft's probabilities (spec_decode.py's random kernels), end to
    end on the card (sampled tokens differ from greedy ones: lengths and
    counters are checked; the kernels are checked against vLLM's elsewhere)."""
    spec = {
        "method": "draft_model",
        "model": draft_dir,
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    got = _generate(tiny_llama_dir, spec, temperature=0.8)
    assert [len(t) for t in got["tokens"]] == [N_TOKENS] * len(PROMPTS)
    c = got["counters"]
    assert 0 <= c["vllm:spec_decode_num_accepted_tokens"] <= c["vllm:spec_decode_num_draft_tokens"]
    assert c["vllm:spec_decode_num_draft_tokens"] > 0
    assert got["fallbacks"] == {}
