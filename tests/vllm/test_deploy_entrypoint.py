"""The image's entry command (deploy/entrypoint.sh, `spyre-serve` in the
image) serves a model here: healthy only after the warm-up compiled every
bucket, /metrics with vLLM's series and the spyre:* ones, a completion equal
to transformers on the CPU, and a clean stop on SIGTERM (as the kubelet
stops a pod)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "deploy" / "entrypoint.sh"
PROMPT = [1, 17, 42, 99, 5]

pytestmark = pytest.mark.slow  # a vllm serve process with its warm-up: ~40-60 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([\d.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_entrypoint_serves_after_warm_up_with_metrics(
    tiny_llama_dir, tiny_llama_ref, hf_greedy, vllm_server, monkeypatch
):
    want = hf_greedy(tiny_llama_ref, PROMPT, 4)  # before the server takes the cores
    # what an in-process engine of this session left in the environment is not
    # the pod's; the entrypoint's own defaults apply, as in the image
    for k in (
        "_TORCH_SPYRE_VLLM_METRICS_PROXY_PID",
        "_TORCH_SPYRE_VLLM_METRICS_PICKED_PORT",
        "TORCH_SPYRE_VLLM_WARMUP",
        "TORCH_SPYRE_NUM_CARDS",
        "TORCH_SPYRE_VLLM_COMPILE",
    ):
        monkeypatch.delenv(k, raising=False)  # fmt: skip
    env = {
        "SPYRE_PYTHON": sys.executable, "SPYRE_SERVED_MODEL_NAME": "tiny",
        "TORCH_SPYRE_VLLM_METRICS_PORT": str(_free_port()), "TORCH_SPYRE_VLLM_LOG_STEPS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
    }  # fmt: skip
    # the fixture adds --port and --host: the entrypoint passes them on (last one wins)
    base, proc, log = vllm_server(
        tiny_llama_dir, "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "64",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
        "--kv-cache-memory-bytes", str(8 << 20), env=env, launcher=["bash", str(ENTRY)],
    )  # fmt: skip
    at_ready = log.read_text()
    # ready only after the warm-up compiled both token buckets (16, 32)
    assert "spyre-serve: " in at_ready
    tail = at_ready[-3000:]
    assert "spyre: warm-up 2/2" in at_ready and "spyre: warm-up done" in at_ready, tail

    metrics = _get(base + "/metrics")
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        _metric(metrics, name)  # what llm-d's endpoint picker reads
    assert re.search(r"^spyre:\w+", metrics, re.M), metrics[-2000:]
    steps_before = _metric(metrics, "spyre:steps_total")

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        tokens = json.loads(r.read())["choices"][0]["token_ids"]
    assert tokens == want
    metrics = _get(base + "/metrics")
    assert _metric(metrics, "spyre:steps_total") >= steps_before + 4
    assert _metric(metrics, "spyre:modelled_device_seconds_total") > 0
    # no bucket compiled after the warm-up: the request paid no compile
    compiled = "-token bucket compiled"
    assert log.read_text().count(compiled) == at_ready.count(compiled)

    proc.send_signal(signal.SIGTERM)  # exec'd: vLLM itself gets it, as from the kubelet
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within 60 s of SIGTERM:\n{log.read_text()[-3000:]}")
