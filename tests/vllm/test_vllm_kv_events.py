"""vLLM's KV-cache events from an engine on the card (issue 29, llm-d's
signals): llm-d's precise prefix-cache scorer subscribes to them (ZMQ,
msgpack ``KVEventBatch``) to route a request to the pod holding its prefix.
The events come from vLLM's block manager, which the spyre platform leaves
as it is (prefix caching on, 16-token blocks); read back here as a scorer
reads them, and checked against the prompt's full blocks and the cache hit
they announce."""

from __future__ import annotations

import gc
import socket
import threading
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_block_stored_events_announce_the_prompt_blocks(tiny_llama_dir):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    port = _free_port()
    batches: list = []
    stop = threading.Event()

    def subscribe() -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not stop.is_set():
            try:
                parts = sock.recv_multipart()
            except zmq.Again:
                continue
            batches.append(decode.decode(parts[-1]))
        sock.close()

    reader = threading.Thread(target=subscribe, daemon=True)
    reader.start()
    llm = LLM(
        model=tiny_llama_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
        max_num_seqs=4, block_size=16, enable_prefix_caching=True,
        kv_cache_memory_bytes=8 << 20, seed=0,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{port}", "topic": "kv"},
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = [(7 * i + 3) % 256 for i in range(40)]  # two full 16-token blocks
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": prompt + [5, 6]}], params, use_tqdm=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not batches:
            time.sleep(0.1)
    finally:
        stop.set()
        reader.join(timeout=5)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored, batches
    tokens = [t for e in stored for t in e.token_ids]
    hashes = [h for e in stored for h in e.block_hashes]
    assert tokens[:32] == prompt[:32] and all(e.block_size == 16 for e in stored)
    assert len(hashes) == len(set(hashes)) >= 2
    # the second request found the two announced blocks in the cache
    assert again[0].num_cached_tokens == 32
