"""Shared set-up for the vLLM plugin tests (skipped when vLLM is not installed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from torch_spyre import settings

# The engine core in this process: ~10 s faster start per LLM, and the worker's
# state (step statistics, device placement) is reachable for the checks.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_SPYRE_VLLM_LOG_STEPS", "0")
settings.reload()  # torch_spyre read its settings before this file set one

# vLLM is imported lazily by the tests (not at collection): importing it has
# process-wide effects (logging, torch settings) the rest of the suite should not see.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(
        reason="vllm is not installed (bash scripts/install.sh vllm; docs/serving.md)"
    )
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_greedy():
    """The CPU reference greedy decoder (a fixture: test modules cannot import
    this conftest by name when the whole suite runs)."""
    return _hf_greedy


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The CPU reference: n greedy tokens, never stopping early (vLLM runs with
    ignore_eos), argmax on fp32 logits through transformers' own KV cache."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
    return tokens


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random-weight llama checkpoint (GQA, untied head), built here."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        # head_dim 32 (128 / 4 heads): one fp32 stick; the compiled path cannot yet
        # split a stick dim into heads narrower than a stick (docs/compiler.md)
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # wider than the default 0.02 so logits are spread out: greedy ties between
        # two tokens (which no implementation can be asked to break alike) are rare
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_ref(tiny_llama_dir: str) -> torch.nn.Module:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """Start `vllm serve` subprocesses: ``start(model, *args, env=...)`` returns
    (base URL, its Popen, its log file) once /health is 200; each is terminated
    after the module.  ``launcher`` replaces ``python -m vllm... serve`` (e.g.
    deploy/entrypoint.sh, which takes the same arguments)."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    procs = []

    def start(
        model: str,
        *args: str,
        env: dict | None = None,
        timeout: float = 300,
        launcher: list[str] | None = None,
    ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        serve = launcher or [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
        cmd = [*serve, model, "--port", str(port), "--host", "127.0.0.1", *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**full_env, **(env or {})}
            )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    return base, proc, log
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(
                    f"vllm serve did not come up in {timeout} s:\n{log.read_text()[-4000:]}"
                )
            time.sleep(1)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
