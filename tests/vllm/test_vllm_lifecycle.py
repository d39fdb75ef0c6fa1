"""A vLLM server on spyre from start to stop: a clear error when the model does
not fit, warm before healthy, spyre:* series on the API server's /metrics, and
a graceful drain (in-flight requests finish within --shutdown-timeout)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest


def test_model_that_does_not_fit_fails_fast_naming_both_amounts(tiny_llama_dir):
    code = textwrap.dedent(
        f"""
        import os, time
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        t = time.time()
        try:
            LLM(model={tiny_llama_dir!r}, skip_tokenizer_init=True, dtype="float32",
                max_model_len=64, kv_cache_memory_bytes=64 << 20)
        except Exception as e:
            print("ERROR", round(time.time() - t, 1), str(e).splitlines()[-1])
        """
    )
    env = {"TORCH_SPYRE_DEVICE_MEMORY": "32MiB", "HF_HUB_OFFLINE": "1"}
    import os

    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    seconds = float(line.split()[1])
    assert "does not fit on the card" in line and "KV cache 0.06 GiB" in line, line
    assert "--kv-cache-memory-bytes" in line and "TORCH_SPYRE_DEVICE_MEMORY" in line
    assert seconds < 60  # before loading anything onto the card


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.mark.slow  # one server (~30 s)
def test_warm_metrics_and_graceful_drain(vllm_server, tiny_llama_dir):
    base, proc, log_file = vllm_server(
        tiny_llama_dir, "--dtype", "float32", "--max-model-len", "256",
        "--max-num-batched-tokens", "64", "--kv-cache-memory-bytes", str(8 << 20),
        "--skip-tokenizer-init", "--shutdown-timeout", "120", "--served-model-name", "tiny",
        env={"TORCH_SPYRE_VLLM_LOG_STEPS": "1"},
    )  # fmt: skip
    log = log_file.read_text()
    # warm when healthy: every bucket compiled before the server answered /health
    warmed = re.findall(r"warm-up (\d+)/(\d+): the (\d+)-token bucket", log)
    assert [b for _, _, b in warmed] == ["16", "32", "64"], log[-3000:]
    assert "warm-up done" in log

    # one scrape target: the worker's spyre:* series on the API server's /metrics
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
    metrics = _get(base + "/metrics")
    steps = [ln for ln in metrics.splitlines() if ln.startswith("spyre:steps_total ")]
    assert steps and float(steps[0].split()[1]) >= 4, metrics[-2000:]
    assert "vllm:num_requests_running" in metrics
    assert "compiled the forward" not in log_file.read_text()[len(log) :]  # nothing new

    # graceful drain: a streaming request in flight when SIGTERM arrives finishes
    n = 48
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    chunks, done = 0, False
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks += 1
            if chunks == 2:
                proc.send_signal(signal.SIGTERM)
    assert done and chunks == n, (done, chunks)
    proc.wait(timeout=120)
    assert time.time() - t0 < 120
