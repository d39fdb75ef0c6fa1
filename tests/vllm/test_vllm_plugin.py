"""The plugin's pieces without an engine: entry points, slot mapping, paged attention."""

from __future__ import annotations

import logging
import math
import os
from importlib.metadata import entry_points

import pytest
import torch

import torch_spyre.vllm_plugin as plugin  # imports no vLLM
from torch_spyre.runtime import dispatch_stats
from torch_spyre.vllm_plugin import kernels  # imports no vLLM


@pytest.fixture
def attention():
    from torch_spyre.vllm_plugin import attention

    return attention


def test_entry_points_name_the_plugin():
    platforms = {ep.name: ep.value for ep in entry_points(group="vllm.platform_plugins")}
    general = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert platforms.get("spyre") == "torch_spyre.vllm_plugin:register"
    assert general.get("spyre_layers") == "torch_spyre.vllm_plugin:register_ops"


def test_platform_is_spyre_and_can_be_switched_off(spyre_settings):
    from vllm.platforms import current_platform

    assert current_platform.device_name == "spyre"
    assert current_platform.device_type == "cpu"
    assert current_platform.is_out_of_tree()
    assert plugin.register() == plugin.PLATFORM_QUALNAME
    spyre_settings(vllm=False)
    assert plugin.register() is None


def test_plugin_stands_down_for_ibms_when_it_is_selected(monkeypatch, caplog):
    import importlib.metadata
    from importlib.metadata import EntryPoint

    ibm = EntryPoint("spyre_inference", "spyre_inference:register", "vllm.platform_plugins")
    real = importlib.metadata.entry_points

    def with_ibm(**kw):
        eps = real(**kw)
        if kw.get("group") == "vllm.platform_plugins":
            return importlib.metadata.EntryPoints([*eps, ibm])
        return eps

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert plugin.register() == plugin.PLATFORM_QUALNAME  # IBM's is not installed here
    monkeypatch.setattr(importlib.metadata, "entry_points", with_ibm)
    # vLLM's "vllm" logger does not propagate to the root, where caplog listens
    logger = logging.getLogger("vllm.torch_spyre")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="vllm.torch_spyre"):
            assert plugin.register() is None
    finally:
        logger.removeHandler(caplog.handler)
    assert "stands down" in caplog.text and "spyre_inference" in caplog.text
    monkeypatch.setenv("VLLM_PLUGINS", "spyre_inference,spyre")
    assert plugin.register() is None
    monkeypatch.setenv("VLLM_PLUGINS", "spyre,spyre_layers")
    assert plugin.register() == plugin.PLATFORM_QUALNAME


def test_slot_mapping_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    bs, max_tokens, stride = 4, 40, 8
    q_lens = [3, 0, 5, 1]  # an empty request included
    ctx = [2, 0, 9, 20]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens)]).to(torch.int64)
    table = torch.randperm(64, generator=g)[: 4 * stride].reshape(4, stride).to(torch.int32)
    out = torch.full((max_tokens,), 7, dtype=torch.int64)
    n = int(qsl[-1])
    kernels.compute_slot_mapping(n, max_tokens, qsl, positions, table, stride, out, bs, PAD_ID=-1)
    expected = []
    for r, (c, q) in enumerate(zip(ctx, q_lens)):
        for p in range(c, c + q):
            expected.append(int(table[r, p // bs]) * bs + p % bs)
    assert out[:n].tolist() == expected
    assert (out[n:] == -1).all()


def _reference_attention(q, keys, values, ctx_lens, q_lens, scale, group):
    """Per request, per query token: softmax over its causal context (fp64)."""
    outs = []
    start = 0
    for r, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        k = keys[r].double().repeat_interleave(group, 1)  # [S, H, D]
        v = values[r].double().repeat_interleave(group, 1)
        for j in range(n):
            qi = q[start + j].double()  # [H, D]
            visible = c + j + 1
            w = torch.softmax(torch.einsum("hd,shd->hs", qi, k[:visible]) * scale, dim=-1)
            outs.append(torch.einsum("hs,shd->hd", w, v[:visible]))
        start += n
    return torch.stack(outs).float()


def test_paged_attention_matches_a_dense_reference(attention):
    """Mixed batch: a decode, a chunk after cached context, a fresh prefill."""
    g = torch.Generator().manual_seed(1)
    h, kvh, d, bs, num_blocks = 4, 2, 16, 4, 32
    ctx_lens, q_lens = [7, 5, 0], [1, 6, 9]
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    table = torch.randperm(num_blocks, generator=g)[:12].reshape(3, 4).to(torch.int32)
    keys = [torch.randn(s, kvh, d, generator=g) for s in seq_lens]
    values = [torch.randn(s, kvh, d, generator=g) for s in seq_lens]
    cache = torch.zeros(2, num_blocks, bs, kvh, d)
    for r, s in enumerate(seq_lens):  # what earlier steps and do_kv_cache_update wrote
        for p in range(s):
            cache[0, table[r, p // bs], p % bs] = keys[r][p]
            cache[1, table[r, p // bs], p % bs] = values[r][p]
    query = torch.randn(sum(q_lens), h, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    groups, out_index = attention.build_indices(qsl, torch.tensor(seq_lens), table, bs)
    assert [g["num_reqs"] for g in groups] == [1, 2]  # the decode apart from the prefills
    meta = attention.SpyreAttentionMetadata(
        num_actual_tokens=sum(q_lens),
        slots=torch.zeros(0, dtype=torch.int64).to("spyre"),
        groups=[attention.to_card(g) for g in groups],
        out_index=None,
        block_size=bs,
    )
    scale = 1 / math.sqrt(d)
    impl = attention.SpyreAttentionImpl(h, d, scale, kvh, None, None, "auto")
    out = torch.empty(sum(q_lens), h, d).to("spyre")
    before = dispatch_stats.counts("kernel").get("paged_attention", 0)
    impl.forward(None, query.to("spyre"), None, None, cache.to("spyre"), meta, out)
    ref = _reference_attention(query, keys, values, ctx_lens, q_lens, scale, h // kvh)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    # one paged-attention program per group, no host fallback
    assert dispatch_stats.counts("kernel").get("paged_attention", 0) - before == 2


@pytest.mark.parametrize("what", ["alibi_slopes", "kv_cache_dtype"])
def test_unsupported_attention_features_are_named(attention, what):
    kwargs = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"}
    kwargs[what] = [1.0] if what == "alibi_slopes" else "fp8"
    with pytest.raises(NotImplementedError, match=what):
        attention.SpyreAttentionImpl(4, 16, 0.25, 2, **kwargs)


def test_token_buckets(spyre_settings):
    from torch_spyre.vllm_plugin import compile as spyre_compile

    spyre_settings(vllm_buckets=None)
    assert spyre_compile.buckets(32) == [16, 32]
    assert spyre_compile.buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert spyre_compile.buckets(100) == [16, 32, 64, 100]
    assert spyre_compile.buckets(8) == [8]
    sizes = spyre_compile.buckets(100)
    picked = [spyre_compile.bucket_for(n, sizes) for n in (1, 16, 17, 65, 100)]
    assert picked == [16, 16, 32, 100, 100]
    with pytest.raises(ValueError, match="exceed"):
        spyre_compile.bucket_for(101, sizes)
    spyre_settings(vllm_buckets=(8, 64))
    assert spyre_compile.buckets(100) == [8, 64, 100]
    spyre_settings(vllm_compile=False)
    assert not spyre_compile.enabled()


def test_engine_processes_fork_unless_the_user_chose(monkeypatch):
    """``vllm serve`` sets ``spawn`` for every platform after the platform is
    chosen; the spyre platform forks its engine (no second import of torch and
    vLLM) unless the user had set a start method before vLLM started."""
    import vllm.utils.gc_utils

    from torch_spyre.vllm_plugin.platform import start_method

    frozen = []
    monkeypatch.setattr(vllm.utils.gc_utils, "freeze_gc_heap", lambda: frozen.append(1))
    monkeypatch.setattr(plugin, "MP_METHOD_AT_START", None)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # cli_env_setup's
    assert start_method() == "fork"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert frozen == [1]  # `vllm serve`'s API server freezes its heap before the fork
    # unset (vLLM as a library): vLLM's own default, fork, and no variable written
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    assert start_method() == "fork"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert frozen == [1]  # a user's process is not frozen
    monkeypatch.setattr(plugin, "MP_METHOD_AT_START", "spawn")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert start_method() == "spawn"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def _frozen_in_child(conn) -> None:
    import gc

    from torch_spyre.vllm_plugin.worker import freeze_inherited_heap

    conn.send((freeze_inherited_heap(), gc.get_freeze_count()))


def test_a_forked_engine_freezes_the_heap_it_inherited():
    """vLLM's engine runs several full collections while it loads a model; in
    a forked engine they skip the objects inherited from the parent."""
    import gc
    import multiprocessing

    from torch_spyre.vllm_plugin.worker import freeze_inherited_heap

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_frozen_in_child, args=(child,))
    proc.start()
    assert parent.poll(60)
    froze, count = parent.recv()
    proc.join(60)
    assert froze and count > 100_000, count  # every module torch and vLLM loaded
    before = gc.get_freeze_count()
    assert not freeze_inherited_heap()  # this process was not forked by multiprocessing
    assert gc.get_freeze_count() == before


def test_the_start_method_is_recorded_before_vllm_serve_sets_it(monkeypatch):
    monkeypatch.setattr(plugin, "_asked", False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    plugin.register()
    assert plugin.MP_METHOD_AT_START is None
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    plugin.register()  # asked again later: the first answer stands
    assert plugin.MP_METHOD_AT_START is None
    monkeypatch.setattr(plugin, "_asked", False)
    plugin.register()
    assert plugin.MP_METHOD_AT_START == "spawn"


def test_torch_event_works_after_vllms_cpu_worker_is_imported():
    """vLLM's CPU worker imports a module that replaces torch.Event process-wide
    with a placeholder; the plugin's worker puts the real class back, so spyre
    events still time streams in a process that ran an engine."""
    import sys

    from torch_spyre.vllm_plugin import worker  # noqa: F401

    assert "vllm.v1.worker.cpu.shm" in sys.modules  # the module that replaces it
    assert torch.Event is torch._C.Event
    start, end = (
        torch.Event(device="spyre", enable_timing=True),
        torch.Event(device="spyre", enable_timing=True),
    )
    start.record()
    torch.ones(64, device="spyre").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
