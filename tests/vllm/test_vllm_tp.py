"""Tensor parallel on spyre through vLLM: each worker on its own card, vLLM's
parallel linear / embedding / LM-head layers sharded, collectives over
spyreccl; greedy tokens equal one card and transformers on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

HERE = Path(__file__).parent
ROOT = str(HERE.parents[1])
TINY = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, head_dim=32, tie_word_embeddings=False,
)  # fmt: skip


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 23)]


def run_tp(model_dir: str, tp: int, eager: bool) -> tuple[list[list[int]], str]:
    # a fresh server process: not this process's metrics port (an in-process engine
    # of another test serves it already)
    skip = ("TORCH_SPYRE_VLLM_METRICS_PORT", "_TORCH_SPYRE_VLLM_METRICS_PROXY_PID")
    env = {
        **{k: v for k, v in os.environ.items() if k not in skip},
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(":"),
        "TORCH_SPYRE_NUM_CARDS": str(tp),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "TORCH_SPYRE_VLLM_LOG_STEPS": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        r = subprocess.run(
            [sys.executable, str(HERE / "tp_worker.py"), model_dir, str(tp),
             "1" if eager else "0", json.dumps(_prompts()), out],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        log = r.stdout + r.stderr
        assert r.returncode == 0 and os.path.exists(out), log[-5000:]
        with open(out) as f:
            return json.load(f), log


def _check(log: str, tp: int) -> None:
    # every card logs its steps, with the collectives' share of the modelled time
    steps = re.findall(
        r"spyre step \d+ \(card (\d)\): .* modelled device time ([\d.]+) ms, of which "
        r"collectives ([\d.]+) ms",
        log,
    )
    assert {int(c) for c, _, _ in steps} == set(range(tp)), log[-3000:]
    assert all(0 < float(c) < float(t) for _, t, c in steps)
    # vLLM's parallel layers split the weights over the cards
    sizes = [float(x) for x in re.findall(r"model moved to the card: ([\d.]+) MiB", log)]
    assert len(sizes) == tp, log[-3000:]


def _model(tmp_path, config) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ref.save_pretrained(tmp_path)
    return str(tmp_path), ref


def _tp1(model_dir: str) -> list[list[int]]:
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, kv_cache_memory_bytes=8 << 20, seed=0, enforce_eager=True,
    )  # fmt: skip
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY),
    # vLLM's FusedMoE with its experts tensor-parallel (each card a slice of
    # every expert's intermediate dim, one all-reduce after the experts)
    "mixtral": lambda: transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2
    ),
}


@pytest.mark.slow  # two worker processes (~25 s)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tp2_greedy_equals_tp1_and_cpu(arch, tmp_path, hf_greedy):
    model_dir, ref = _model(tmp_path, CONFIGS[arch]())
    tokens, log = run_tp(model_dir, 2, eager=True)
    expected = [hf_greedy(ref, p, 10) for p in _prompts()]
    assert tokens == expected, (arch, tokens, expected)
    assert _tp1(model_dir) == tokens
    _check(log, 2)


@pytest.mark.slow  # compiled forward graphs in two workers (~40 s)
def test_tp2_compiled_llama(tmp_path, hf_greedy):
    model_dir, ref = _model(tmp_path, CONFIGS["llama"]())
    tokens, log = run_tp(model_dir, 2, eager=False)
    assert tokens == [hf_greedy(ref, p, 10) for p in _prompts()]
    assert "warm-up done" in log
    _check(log, 2)


@pytest.mark.slow  # four worker processes on a small machine (~60 s)
def test_tp4_llama(tmp_path, hf_greedy):
    # 4 query heads and 2 KV heads over 4 cards: vLLM replicates the KV heads
    model_dir, ref = _model(tmp_path, CONFIGS["llama"]())
    tokens, log = run_tp(model_dir, 4, eager=True)
    assert tokens == [hf_greedy(ref, p, 10) for p in _prompts()]
    _check(log, 4)


@pytest.mark.slow  # eight worker processes (~45 s on two cores)
def test_tp8_llama(tmp_path, hf_greedy):
    """A full system: 8 cards, 8 query and KV heads, one each per card."""
    wide = {**TINY, "hidden_size": 256, "intermediate_size": 512}
    wide.update(num_attention_heads=8, num_key_value_heads=8)
    model_dir, ref = _model(tmp_path, transformers.LlamaConfig(**wide))
    tokens, log = run_tp(model_dir, 8, eager=True)
    assert tokens == [hf_greedy(ref, p, 10) for p in _prompts()]
    _check(log, 8)


def test_tp_needs_cards():
    """More tensor-parallel ranks than cards: an error that says what to set."""
    from torch_spyre.vllm_plugin.platform import _check_parallel

    class P:
        pipeline_parallel_size = 1
        data_parallel_size = 1
        tensor_parallel_size = 3

    with pytest.raises(ValueError, match="needs 3 cards .* set TORCH_SPYRE_NUM_CARDS=3"):
        _check_parallel(P())
    P.tensor_parallel_size = 9
    with pytest.raises(ValueError, match="at most 8"):
        _check_parallel(P())
    P.tensor_parallel_size, P.pipeline_parallel_size = 1, 2
    with pytest.raises(NotImplementedError, match="pipeline parallel"):
        _check_parallel(P())


def test_platform_uses_spyreccl():
    from torch_spyre.vllm_plugin.platform import SpyrePlatform

    assert SpyrePlatform.dist_backend == "spyreccl"
    assert SpyrePlatform.get_device_communicator_cls().endswith("SpyreCommunicator")


def _complete(base: str, prompt: list[int]) -> list[int]:
    import urllib.request

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


@pytest.mark.slow  # a server with 2 or 4 worker processes (~40-70 s)
@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_serve_tp(tp, tmp_path, vllm_server, monkeypatch, hf_greedy):
    """`vllm serve --tensor-parallel-size N`: tokens equal one card and the CPU;
    the collective series on the server's /metrics."""
    import urllib.request

    model_dir, ref = _model(tmp_path, CONFIGS["llama"]())
    one_card = _tp1(model_dir)
    # the server picks its own metrics port (not this process's in-process engine's)
    monkeypatch.delenv("TORCH_SPYRE_VLLM_METRICS_PORT", raising=False)
    monkeypatch.delenv("_TORCH_SPYRE_VLLM_METRICS_PROXY_PID", raising=False)
    base, _, log = vllm_server(
        model_dir, "--served-model-name", "tiny", "--skip-tokenizer-init",
        "--tensor-parallel-size", str(tp), "--dtype", "float32", "--max-model-len", "128",
        "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(8 << 20), "--enforce-eager",
        env={"TORCH_SPYRE_NUM_CARDS": str(tp), "OMP_NUM_THREADS": "1",
             "TORCH_SPYRE_VLLM_LOG_STEPS": "1",
             "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(":")},
    )  # fmt: skip
    tokens = [_complete(base, p) for p in _prompts()]
    assert tokens == one_card == [hf_greedy(ref, p, 10) for p in _prompts()]
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r"^spyre:collective_modelled_seconds_total ([\d.e+-]+)$", text, re.M)
    assert m and float(m.group(1)) > 0, text[-2000:]
    _check(log.read_text(), tp)
