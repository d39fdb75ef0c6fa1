"""Paged attention as one kernel program: row-table loads and stores, their
timing (one descriptor per page), and the ``spyre::paged_attention`` op."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Load, Program, ProgramError
from torch_spyre.kernels.flash import PagedKV, best_flash_attention, flash_attention
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.runtime import dispatch_stats
from torch_spyre.sim import estimate, execute, step_costs


def _batch(d: int, seed: int = 0):
    """Three requests over a shuffled cache: a long one, a short one with a
    padded query row, one in between; queries at the end of each context."""
    g = torch.Generator().manual_seed(seed)
    r, q, s, kvh, grp, bs, nb = 3, 4, 48, 2, 2, 16, 10
    lens = [48, 20, 33]
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).half()
    blocks = torch.randperm(nb, generator=g)[:9].view(3, 3)
    kv_rows = torch.full((r, s), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        p = torch.arange(n)
        kv_rows[i, :n] = (blocks[i][p // bs] * bs + p % bs).int()
    q_rows = torch.arange(r * q, dtype=torch.int32).view(r, q).clone()
    q_rows[1, 3] = -1  # padding: never written
    mask = torch.zeros(r, 1, q, s, dtype=torch.bool)
    for i, n in enumerate(lens):
        for j in range(q):
            mask[i, 0, j, : n - q + j + 1] = True
    query = torch.randn(r * q + 2, kvh * grp, d, generator=g).half()
    return query, cache, q_rows, kv_rows, mask, (r, q, s, kvh, grp, bs)


def _reference(query, cache, q_rows, kv_rows, mask, scale, softcap=None, sinks=None):
    """Per query row, fp64 softmax over its request's visible slots."""
    kvh, d = cache.shape[-2:]
    h = query.shape[1]
    pages = cache.reshape(2, -1, kvh, d).double()
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(q_rows.shape[0]):
        slots = kv_rows[i].clamp(min=0).long()
        k = pages[0][slots].repeat_interleave(h // kvh, 1)  # [S, H, D]
        v = pages[1][slots].repeat_interleave(h // kvh, 1)
        for j, row in enumerate(q_rows[i].tolist()):
            if row < 0:
                continue
            sc = torch.einsum("hd,shd->hs", query[row].double(), k) * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            sc = sc.masked_fill(~mask[i, 0, j][None], -math.inf)
            if sinks is not None:
                sc = torch.cat([sc, sinks.double()[:, None]], 1)
            w = torch.softmax(sc, -1)[:, : k.shape[0]]
            out[row] = torch.einsum("hs,shd->hd", w, v)
    return out


def _memory(t: torch.Tensor) -> torch.Tensor:
    lay = SpyreTensorLayout.default(tuple(t.shape), t.dtype)
    mem = torch.zeros(lay.device_numel, dtype=t.dtype)
    lay.store(mem, t)
    return mem


@pytest.mark.parametrize("d", [64, 16])  # whole sticks; rows narrower than a stick
def test_paged_program_matches_a_dense_reference(d):
    query, cache, q_rows, kv_rows, mask, (r, q, s, kvh, grp, bs) = _batch(d)
    t, n = query.shape[0], cache.shape[1] * bs
    p = best_flash_attention(
        r, kvh * grp, kvh, q, s, d, torch.float16, mask=((r, 1, q, s), torch.bool),
        paged=PagedKV(t, n, bs),
    )  # fmt: skip
    assert Program.from_json(p.to_json()) == p  # row tables serialise
    assert "kv[0, kr[kv], h, d]" in str(p)  # the listing names the row table
    out = torch.zeros(t, kvh, grp, d, dtype=torch.float16)
    ops = dict(q=query.view(t, kvh, grp, d), kv=cache.reshape(2, n, kvh, d), q_rows=q_rows,
               kv_rows=kv_rows, mask=mask, out=out)  # fmt: skip
    bufs = {k: _memory(v) for k, v in ops.items()}
    execute(p, bufs)
    got = SpyreTensorLayout.default(tuple(out.shape), out.dtype).to_host(bufs["out"])
    ref = _reference(query, cache, q_rows, kv_rows, mask, 1 / math.sqrt(d))
    # fp16 operands, fp32 accumulation, one fp16 rounding of the output
    torch.testing.assert_close(got.view(t, -1, d).double(), ref, atol=2e-3, rtol=2e-3)
    assert not got[7].any()  # the padded query's row is not written


def test_paged_program_timing_reads_the_pages_once():
    """Decode at batch 16 over 1552 slots: the K/V bytes are read once, one
    descriptor per page (key and value sticks of a slot are adjacent: one
    descriptor for both), so the time is the bytes at the shared-memory rate
    plus the page set-ups, within a few percent."""
    cfg = HardwareConfig()
    r, h, kvh, s, d, bs = 16, 9, 3, 1552, 64, 16
    p = best_flash_attention(
        r, h, kvh, 1, s, d, torch.float16, mask=((r, 1, 1, s), torch.bool),
        paged=PagedKV(r, 31440, bs),
    )  # fmt: skip
    rep = estimate(p, cfg)
    kv_bytes = 2 * r * s * kvh * d * 2
    # + queries, masks and slot tables (each core reads its requests' tables)
    assert kv_bytes <= rep.dram_bytes <= 1.03 * kv_bytes
    floor = kv_bytes / cfg.sustained_bandwidth_Bps
    assert floor < rep.time_s < 1.15 * floor
    # the value load shares the key load's descriptors ...
    v = next(i for i, st in enumerate(p.steps) if isinstance(st, Load) and st.buffer == "vt")
    assert step_costs._shared_page_loads(p) == {v}
    # ... and a descriptor per slot instead of per page would cost far more
    per_slot = replace(
        p,
        steps=tuple(replace(st, rows_run=1) if getattr(st, "rows", None) else st for st in p.steps),
    )
    assert estimate(per_slot, cfg).time_s > 1.5 * rep.time_s


def test_row_tables_are_validated():
    p = flash_attention(
        2, 4, 2, 1, 32, 64, paged=PagedKV(2, 64, 16), mask=((2, 1, 1, 32), torch.bool)
    )
    p.validate()
    bad_dtype = replace(
        p,
        buffers=tuple(replace(b, dtype=torch.float16) if b.name == "kr" else b for b in p.buffers),
    )
    with pytest.raises(ProgramError, match="row table 'kr' must be int32"):
        bad_dtype.validate()
    stick = replace(
        p,
        steps=tuple(
            replace(st, rows_dim=3) if getattr(st, "rows", None) == "kr" else st for st in p.steps
        ),
    )
    with pytest.raises(ProgramError, match="stick dim"):
        stick.validate()


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_paged_attention_op_on_the_card_equals_the_cpu(variant):
    query, cache, q_rows, kv_rows, mask, (_, _, _, _, _, bs) = _batch(64, seed=1)
    softcap = 30.0 if variant == "softcap" else 0.0
    sinks = torch.randn(query.shape[1]) if variant == "sinks" else None
    cpu = torch.zeros_like(query)
    torch.ops.spyre.paged_attention(
        cpu, query, cache, q_rows, kv_rows, mask, 0.125, softcap, sinks, bs
    )
    ref = _reference(query, cache, q_rows, kv_rows, mask, 0.125, softcap or None, sinks)
    torch.testing.assert_close(cpu.double(), ref, atol=2e-3, rtol=2e-3)

    def dev(x):
        return None if x is None else x.to("spyre")

    out = torch.zeros_like(query).to("spyre")
    before = dispatch_stats.counts("kernel").get("paged_attention", 0)
    torch.ops.spyre.paged_attention(
        out, dev(query), dev(cache), dev(q_rows), dev(kv_rows), dev(mask), 0.125, softcap,
        dev(sinks), bs,
    )  # fmt: skip
    assert dispatch_stats.counts("kernel").get("paged_attention", 0) == before + 1
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d", [64, 16])
def test_kv_cache_write_is_one_scatter_kernel(d):
    """A step's keys and values into their slots: one program on the card,
    the same cache as index_copy on the CPU, other slots untouched."""
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 6, 16, 2, d, generator=g).half()
    key, value = (torch.randn(5, 2, d, generator=g).half() for _ in range(2))
    slots = torch.tensor([3, 40, 17, 95, 64], dtype=torch.int32)
    want = cache.clone()
    torch.ops.spyre.kv_cache_write(want, key, value, slots)
    pages = cache.view(2, -1, 2, d)
    assert torch.equal(want.view(2, -1, 2, d)[0, slots.long()], key)
    assert torch.equal(want.view(2, -1, 2, d)[1, slots.long()], value)
    untouched = torch.ones(pages.shape[1], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(want.view(2, -1, 2, d)[:, untouched], pages[:, untouched])

    dev = cache.to("spyre")
    before = dispatch_stats.counts("kernel").get("kv_cache_write", 0)
    torch.ops.spyre.kv_cache_write(dev, key.to("spyre"), value.to("spyre"), slots.to("spyre"))
    assert dispatch_stats.counts("kernel").get("kv_cache_write", 0) == before + 1
    assert torch.equal(dev.cpu(), want)
