"""`vllm serve` on spyre: OpenAI completions/chat (streaming or not), errors, metrics."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
MODEL_NAME = "smollm2"
TOPICS = [
    "the sea", "a cat", "the moon", "bread", "rain", "a library", "trains", "winter",
    "a garden", "music", "the desert", "coffee", "a bridge", "snow", "a forest", "the city",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | bytes, timeout: float = 300) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from torch_spyre.models.offline import folder

    return str(folder("smollm2"))


@pytest.fixture(scope="module")
def expected(smollm2_path, hf_greedy) -> dict[int, str]:
    return _expected(smollm2_path, hf_greedy)


@pytest.fixture(scope="module")
def server(smollm2_path, expected, tmp_path_factory):
    # `expected` first: the CPU reference runs before the server takes the cores
    port, metrics_port = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TORCH_SPYRE_VLLM_METRICS_PORT": str(metrics_port),
        "TORCH_SPYRE_VLLM_LOG_STEPS": "1",
        # the default separate engine-core process, as users run it
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", smollm2_path,
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL_NAME,
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
        "--kv-cache-memory-bytes", str(64 << 20),
        # 16 short prompts fit one 512-token step: 6 buckets to warm, not 10
        "--max-num-batched-tokens", "512",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not come up in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _request(base: str, i: int) -> dict:
    """Request i: completions for even i, chat for odd; streaming for i % 4 >= 2."""
    chat = i % 2 == 1
    stream = i % 4 >= 2
    text = f"Write one sentence about {TOPICS[i]}."
    body: dict = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        url = base + "/v1/chat/completions"
    else:
        body["prompt"] = text
        url = base + "/v1/completions"
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200
        if not stream:
            choice = json.loads(r.read())["choices"][0]
            return {"i": i, "text": choice["message"]["content"] if chat else choice["text"]}
        pieces, done = [], False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                done = True
                break
            for choice in json.loads(payload)["choices"]:
                piece = choice["delta"].get("content") if chat else choice.get("text")
                pieces.append(piece or "")
        assert done, f"request {i}: stream ended without [DONE]"
        return {"i": i, "text": "".join(pieces)}


def _expected(smollm2_path: str, hf_greedy) -> dict[int, str]:
    """The CPU reference text of each request (the tokens vLLM's renderer makes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    out = {}
    for i, topic in enumerate(TOPICS):
        text = f"Write one sentence about {topic}."
        if i % 2:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(text)["input_ids"]
        out[i] = tok.decode(hf_greedy(model, ids, MAX_TOKENS), skip_special_tokens=True)
    return out


def test_sixteen_concurrent_requests_none_lost_or_mixed(server, expected):
    base = server["base"]
    samples: list[str] = []
    stop = threading.Event()

    def watch_metrics() -> None:  # what an endpoint picker sees while requests run
        while not stop.is_set():
            samples.append(_get(base + "/metrics"))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch_metrics, daemon=True)
    watcher.start()
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda i: _request(base, i), range(16)))
    wall = time.time() - t0
    stop.set()
    watcher.join()

    assert sorted(r["i"] for r in results) == list(range(16))  # none lost
    for r in results:  # none mixed up: each answer is its own prompt's greedy text
        assert r["text"] == expected[r["i"]], (r["i"], r["text"], expected[r["i"]])
    assert len({r["text"] for r in results}) > 8  # the prompts really differ

    def gauge(text: str, name: str) -> float:
        vals = [
            float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{")
        ]
        assert vals, f"{name} missing from /metrics"
        return max(vals)

    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        for text in samples:
            gauge(text, name)
    assert max(gauge(t, "vllm:num_requests_running") for t in samples) > 0
    assert max(gauge(t, "vllm:kv_cache_usage_perc") for t in samples) > 0
    final = _get(base + "/metrics")
    assert gauge(final, "vllm:num_requests_running") == 0

    # modelled device time per step: the worker's metrics and its log line
    worker = _get(server["metrics"])
    steps = [ln for ln in worker.splitlines() if ln.startswith("spyre:steps_total ")]
    total = [
        ln for ln in worker.splitlines() if ln.startswith("spyre:modelled_device_seconds_total ")
    ]
    assert steps and float(steps[0].split()[1]) >= MAX_TOKENS
    assert total and float(total[0].split()[1]) > 0
    log = server["log"].read_text()
    assert "modelled device time" in log
    # the layers ran compiled: one graph per token bucket, each compiled once
    compiled = re.findall(r"compiled the forward for the (\d+)-token bucket", log)
    assert compiled and len(compiled) == len(set(compiled)), compiled
    assert "16" in compiled  # the decode steps of the 16 requests
    # the engine process was forked from the API server (platform.start_method):
    # torch was imported once, not again in a spawned engine
    assert "engine processes are forked" in log
    assert log.count("Triton not available") <= 1
    print(f"16 concurrent requests x {MAX_TOKENS} tokens: {wall:.1f} s wall")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": 123, "max_tokens": 4}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "not a list"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ],
)
def test_malformed_request_gets_4xx_and_serving_continues(server, path, body):
    status, _ = _post(server["base"] + path, body)
    assert 400 <= status < 500
    status, payload = _post(
        server["base"] + "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": "The capital of France is",
            "max_tokens": 2,
            "temperature": 0,
        },
    )
    assert status == 200 and json.loads(payload)["choices"][0]["text"]
