"""Multi-LoRA on spyre: a batch mixing adapters and the base model, greedy tokens
equal to peft's merged models on the CPU; adapters added and removed at run time."""

from __future__ import annotations

import gc

import pytest
import torch

GREEDY = dict(temperature=0.0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the last adapter: peft's default targets for llama (no weights for k, o, the MLP)
QV = ["q_proj", "v_proj"]
RANK = 8
N_ADAPTERS = 4
N_TOKENS = 6


def _make_adapter(base_dir: str, out_dir: str, seed: int, targets: list[str]) -> None:
    """A random peft LoRA adapter (rank 8, nonzero A and B) of the tiny llama."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=RANK,
        lora_alpha=2 * RANK,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,  # B random too: every adapter changes the model
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[str]:
    dirs = []
    for i in range(N_ADAPTERS):
        d = str(tmp_path_factory.mktemp(f"lora{i}"))
        _make_adapter(tiny_llama_dir, d, 100 + i, QV if i == N_ADAPTERS - 1 else TARGETS)
        dirs.append(d)
    return dirs


def _merged(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    from vllm import LLM

    llm = LLM(
        model=tiny_llama_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=8 << 20,
        enable_lora=True,
        max_loras=N_ADAPTERS,
        max_lora_rank=RANK,
        seed=0,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _request(i: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"adapter{i}", i + 1, path)


def _generate(llm, prompts, loras):
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=N_TOKENS, **GREEDY),
        lora_request=loras,
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in (3, 9, 14, 5, 11)[:n]]


def _lora_state(worker) -> dict:
    """Runs inside the worker: where the LoRA stacks and metadata live, what ran."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    from torch_spyre.ops import lora as lora_ops
    from torch_spyre.runtime import dispatch_stats
    from torch_spyre.vllm_plugin import lora as lora_plugin

    runner = worker.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, BaseLinearLayerWithLoRA)]
    wrapper = layers[0].punica_wrapper
    return {
        "layers": len(layers),
        "stacks": {t.device.type for m in layers for t in (*m.lora_a_stacked, *m.lora_b_stacked)},
        # B stacks stored transposed (whole sticks of n), as the programs read them
        "b_transposed": {lora_ops.stored_b(list(m.lora_b_stacked))[1] for m in layers},
        "metadata": {
            t.device.type
            for g in (wrapper.tokens, wrapper.sampled)
            for t in (g.index.rows, g.index.rows32, g.index.inv)
        },
        "live": {
            type(m.base_layer).__name__: lora_plugin._live[m.lora_b_stacked[0].data_ptr()].tolist()
            for m in layers[:4]
        },
        "kernels": dict(dispatch_stats.counts("kernel")),
        "stack_shapes": {
            (tuple(m.lora_a_stacked[0].shape), tuple(m.lora_b_stacked[0].shape)) for m in layers[:1]
        },
        "compiled": None if runner.compiled is None else runner.compiled.summary(),
        "slots": runner.lora_manager._adapter_manager.lora_index_to_id,
        "modelled_s": runner.step_stats.modelled_s,
    }


@pytest.mark.slow
def test_mixed_adapter_batch_equals_peft(
    lora_llm, adapters, tiny_llama_dir, tiny_llama_ref, hf_greedy
):
    import torch_spyre
    from torch_spyre.runtime import dispatch_stats

    torch_spyre.reset_fallback_counts()
    prompts = _prompts(N_ADAPTERS + 1, seed=3)
    loras = [_request(i, d) for i, d in enumerate(adapters)] + [None]
    before = dispatch_stats.counts("kernel").get("lora_sgmv", 0)
    t0 = torch.spyre.modelled_time_s()
    got = _generate(lora_llm, prompts, loras)
    t1 = torch.spyre.modelled_time_s()
    base_got = _generate(lora_llm, prompts, [None] * len(prompts))
    # the adapters' programs are card time: the same batch without them is faster
    assert t1 - t0 > torch.spyre.modelled_time_s() - t1
    for i, d in enumerate(adapters):
        want = hf_greedy(_merged(tiny_llama_dir, d), prompts[i], N_TOKENS)
        assert got[i] == want, f"adapter {i}"
    base = hf_greedy(tiny_llama_ref, prompts[-1], N_TOKENS)
    assert got[-1] == base and base_got[-1] == base
    # every adapter changes the tokens of its prompt (the test can tell them apart)
    for i in range(N_ADAPTERS):
        assert got[i] != hf_greedy(tiny_llama_ref, prompts[i], N_TOKENS), f"adapter {i}"
    state = lora_llm.collective_rpc(_lora_state)[0]
    assert state["layers"] == 2 * 4  # qkv, o, gate_up, down per layer
    assert state["stacks"] == {"spyre"} and state["metadata"] == {"spyre"}
    assert state["b_transposed"] == {True}
    # --max-loras slots of --max-lora-rank: A [4, 1, 8, hidden], B [4, 1, q out, 8]
    assert state["stack_shapes"] == {((N_ADAPTERS, 1, RANK, 128), (N_ADAPTERS, 1, 128, RANK))}
    # the compiled forward: per token bucket a graph with the LoRA op (an opaque
    # node) and one without it (steps of base-model requests only), both compiled
    # by the warm-up, none since
    compiled = state["compiled"]
    assert compiled is not None and compiled["graphs"] == 2 * len(compiled["buckets"])
    assert sorted(i for i in state["slots"] if i is not None) == [1, 2, 3, 4]
    # which slots hold weights, per slice: the q/v adapter has none for k, o, the MLP
    qv = state["slots"].index(N_ADAPTERS)
    live = state["live"]
    assert [row[qv] for row in live["SpyreQKVParallelLinear"]] == [True, False, True]
    assert [row[qv] for row in live["SpyreRowParallelLinear"]] == [False]
    assert [row[qv] for row in live["SpyreMergedColumnParallelLinear"]] == [False, False]
    others = [s for s in range(N_ADAPTERS) if s != qv]
    assert all(live["SpyreQKVParallelLinear"][i][s] for i in range(3) for s in others)
    assert torch_spyre.fallback_counts() == {}
    # one indexed program per projection served every step; no grouped fallback
    # (the adapters hold no embedding nor LM-head weights: those layers ran nothing)
    kernels = dispatch_stats.counts("kernel")
    assert kernels.get("lora_sgmv", 0) > before
    assert "lora_sgmv_grouped" not in kernels


@pytest.mark.slow
def test_adapter_removed_and_readded(lora_llm, adapters, tiny_llama_dir, tiny_llama_ref, hf_greedy):
    engine = lora_llm.llm_engine
    prompts = _prompts(2, seed=5)
    req = _request(0, adapters[0])
    want = hf_greedy(_merged(tiny_llama_dir, adapters[0]), prompts[0], N_TOKENS)
    base = hf_greedy(tiny_llama_ref, prompts[1], N_TOKENS)
    assert _generate(lora_llm, prompts, [req, None]) == [want, base]
    assert 1 in engine.list_loras()
    assert engine.remove_lora(1)
    assert 1 not in engine.list_loras()
    slots = lora_llm.collective_rpc(_lora_state)[0]["slots"]
    assert 1 not in slots
    # the base model again for the prompt, then the adapter loaded afresh
    assert _generate(lora_llm, prompts[:1], [None]) == [
        hf_greedy(tiny_llama_ref, prompts[0], N_TOKENS)
    ]
    assert engine.add_lora(req)
    assert 1 in engine.list_loras()
    assert _generate(lora_llm, prompts, [req, None]) == [want, base]


def _post(url: str, body: dict) -> tuple[int, str]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
def test_server_loads_and_unloads_an_adapter(vllm_server, tmp_path):
    """`vllm serve --enable-lora`: /v1/load_lora_adapter adds a peft adapter of
    SmolLM2 at run time, completions name it, /v1/unload_lora_adapter drops it."""
    import json
    import urllib.request

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from torch_spyre.models.offline import folder

    model = str(folder("smollm2"))
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=RANK, target_modules=QV, init_lora_weights=False)
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    url, _, log = vllm_server(
        model,
        "--served-model-name", "smollm2", "--dtype", "float16", "--max-model-len", "256",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
        "--kv-cache-memory-bytes", str(32 << 20),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "TORCH_SPYRE_VLLM_WARMUP": "none"},
    )  # fmt: skip
    body = {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
    code, text = _post(
        url + "/v1/load_lora_adapter",
        {"lora_name": "counting", "lora_path": str(tmp_path / "adapter")},
    )
    assert code == 200, text
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())
    assert "counting" in {m["id"] for m in models["data"]}
    code, text = _post(url + "/v1/completions", {"model": "counting", **body})
    assert code == 200, text
    assert json.loads(text)["choices"][0]["text"]
    # llm-d's LoRA-aware routing reads vLLM's adapter gauge: a series per
    # (max, waiting, running) set, the adapter named while its request ran
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    lora = [m for m in metrics.splitlines() if m.startswith("vllm:lora_requests_info{")]
    assert any('running_lora_adapters="counting"' in m and 'max_lora="2"' in m for m in lora), lora
    assert all("waiting_lora_adapters=" in m for m in lora)
    code, text = _post(url + "/v1/unload_lora_adapter", {"lora_name": "counting"})
    assert code == 200, text
    code, text = _post(url + "/v1/completions", {"model": "counting", **body})
    assert code == 404, text
    code, text = _post(url + "/v1/completions", {"model": "smollm2", **body})
    assert code == 200, text
    assert "spyre: LoRA weight stacks in device memory" in log.read_text()
