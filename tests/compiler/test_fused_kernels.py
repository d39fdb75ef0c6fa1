"""Multi-matmul kernel programs: the fused SwiGLU MLP and flash attention.

Both are reached through ``torch.compile(fullgraph=True)`` on spyre tensors
(the SwiGLU pattern by the spyre post-grad pass, attention by the
``spyre::attention`` op registered ahead of PyTorch's SDPA decomposition) and
run as ONE kernel program each; values match the CPU at the dtype's
tolerances, nothing falls back to the host.  Large shapes are only timed
(``torch_spyre.sim.timing_only``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch_spyre import kernels
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Dim, Matmul, Store
from torch_spyre.kernels import options
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats
from torch_spyre.sim import estimate, timing_only
from torch_spyre.testing import tolerances

H = torch.float16


def _run_compiled(fn, args, dtype, **planning):
    """(output, kernels of a profiled second call, host fallbacks) of ``fn``
    compiled on spyre tensors."""
    torch._dynamo.reset()
    dev = [a.to("spyre") if isinstance(a, torch.Tensor) else a for a in args]
    with options.planning(**planning):
        cf = torch.compile(fn, fullgraph=True, dynamic=False)
        dispatch_stats.reset("fallback")
        cf(*dev)
        with profile() as prof:
            out = cf(*dev)
    return out, prof.kernels, dispatch_stats.counts("fallback"), prof.fallbacks


def _program(name: str):
    """The kernel program last built under ``name`` (from the kernel cache)."""
    from torch_spyre.runtime import launch

    progs = [k.program for k in launch._cache.values() if k.program and k.program.name == name]
    assert progs, name
    return progs[-1]


# ------------------------------------------------------------------ SwiGLU
def swiglu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _mlp_args(lead, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*lead, k, generator=g).to(dtype),
        (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype),
        (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype),
        (torch.randn(k, n, generator=g) / math.sqrt(n)).to(dtype),
    ]


@pytest.mark.parametrize(
    "lead,dtype", [((2, 16), H), ((77,), H), ((1, 77), torch.float32)], ids=str
)
def test_swiglu_mlp_is_one_program_matching_cpu(lead, dtype):
    args = _mlp_args(lead, 128, 320, dtype)
    out, ks, fallbacks, prof_fallbacks = _run_compiled(swiglu, args, dtype)
    want = swiglu(*[a.double() for a in args]).to(dtype)
    torch.testing.assert_close(out.cpu(), want, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    assert len(ks) == 1 and ks[0].name.startswith("swiglu_mlp_"), [k.name for k in ks]
    mms = [s for s in _program(ks[0].name).steps if isinstance(s, Matmul)]
    assert len(mms) == 3  # gate, up and down on the PE array
    # only the output is stored: the hidden activation stays in the LX
    assert [s.operand for s in _program(ks[0].name).steps if isinstance(s, Store)] == ["out"]


def merged_swiglu(x, wgu, wd, res):
    """vLLM's MLP: one merged gate/up projection, ``SiluAndMul`` on its halves."""
    y = F.linear(x, wgu)
    n = y.shape[-1] // 2
    return res + F.linear(F.silu(y[..., :n]) * y[..., n:], wd)


@pytest.mark.parametrize("lead,dtype", [((16,), H), ((2, 5), torch.float32)], ids=str)
def test_merged_gate_up_is_one_program_reading_the_halves_in_place(lead, dtype):
    x, wg, wu, wd = _mlp_args(lead, 128, 320, dtype)
    res = torch.randn(*lead, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    wgu = torch.cat([wg, wu])
    out, ks, fallbacks, prof_fallbacks = _run_compiled(merged_swiglu, [x, wgu, wd, res], dtype)
    want = merged_swiglu(*[a.double() for a in (x, wgu, wd, res)]).to(dtype)
    torch.testing.assert_close(out.cpu(), want, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    assert [k.name for k in ks] == [f"swiglu_mlp_{math.prod(lead)}x128x320x128_res"]
    # one [2n, k] weight operand, the up rows read from row n: no copy of a half
    prog = _program(ks[0].name)
    assert [o.name for o in prog.operands if o.name.startswith("w")] == ["wgu", "wd"]
    assert {s.offsets for s in prog.steps if getattr(s, "operand", None) == "wgu"} == {
        (0, 0),
        (320, 0),
    }


def test_eager_swiglu_of_row_halves_equals_the_copied_halves():
    """``swiglu_mlp(x, w[:n], w[n:], wd)`` reads ``w`` in place (no re-lay of a
    view), bit-equal to the program on separate copies."""
    x, wg, wu, wd = (a.to("spyre") for a in _mlp_args((16,), 128, 320, H))
    wgu = torch.cat([wg, wu])
    with profile() as prof:
        out = torch.ops.spyre.swiglu_mlp(x, wgu[:320], wgu[320:], wd)
    assert [k.name for k in prof.kernels] == ["swiglu_mlp_16x128x320x128"]
    assert prof.transfers == []
    apart = torch.ops.spyre.swiglu_mlp(x, wgu[:320].clone(), wgu[320:].clone(), wd)
    assert torch.equal(out.cpu(), apart.cpu())


def test_swiglu_unfused_plan_keeps_the_matmuls_apart():
    args = _mlp_args((16,), 128, 256, H)
    out, ks, *_ = _run_compiled(swiglu, args, H, fusion=False)
    torch.testing.assert_close(out.cpu(), swiglu(*[a.float() for a in args]).to(H), **tolerances(H))
    assert len(ks) >= 3 and not any(k.name.startswith("swiglu") for k in ks)


def test_fused_swiglu_at_granite_size_reads_every_weight_once():
    """The Granite MLP (M=512), planned and timed only (no values)."""
    fused = kernels.best_swiglu_mlp(1, 512, 4096, 12800, 4096, batched=False)
    rep = estimate(fused)
    # every weight read once (multicast over the row-splitting cores)
    weights = 3 * 4096 * 12800 * 2
    assert weights <= rep.dram_bytes < 1.05 * weights
    # separate programs would also move the hidden activations (gate, up,
    # product: written and read back) through device memory
    hidden = 2 * 512 * 12800 * 2 * 3
    assert rep.time_s < (weights + hidden) / HardwareConfig().sustained_bandwidth_Bps
    with timing_only():  # and it launches on the card without computing
        x, wg, wu = (
            torch.empty(s, dtype=H, device="spyre") for s in ((512, 4096),) + ((12800, 4096),) * 2
        )
        wd = torch.empty(4096, 12800, dtype=H, device="spyre")
        with profile() as prof:
            torch.ops.spyre.swiglu_mlp(x, wg, wu, wd)
    assert [k.time_s for k in prof.kernels] == [pytest.approx(rep.time_s)]


def _swiglu_residual(scale):
    def fn(res, x, wg, wu, wd):
        y = swiglu(x, wg, wu, wd)
        return res + (y if scale is None else y * scale)

    return fn


@pytest.mark.parametrize(
    "lead,dtype,scale",
    [((2, 16), H, 0.22), ((77,), H, None), ((1, 8), H, 0.5), ((1, 40), torch.float32, 0.22)],
    ids=str,
)
def test_residual_add_is_the_swiglu_programs_epilogue(lead, dtype, scale):
    """``res + mlp`` and Granite's ``res + mlp * c``: one program, the add
    in the down projection's epilogue (``spyre::swiglu_mlp_add``)."""
    args = _mlp_args(lead, 128, 320, dtype)
    res = torch.randn(*lead, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    fn = _swiglu_residual(scale)
    out, ks, fallbacks, prof_fallbacks = _run_compiled(fn, [res, *args], dtype)
    want = fn(*[a.double() for a in (res, *args)]).to(dtype)
    torch.testing.assert_close(out.cpu(), want, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    assert [k.name for k in ks] == [_program(ks[0].name).name]
    assert ks[0].name.startswith("swiglu_mlp_") and ks[0].name.endswith("_res")
    prog = _program(ks[0].name)
    assert "res" in [o.name for o in prog.operands]
    assert [s.operand for s in prog.steps if isinstance(s, Store)] == ["out"]


def test_residual_swiglu_with_the_hidden_dim_split_over_cores():
    """The cores splitting the hidden dim all-reduce, then each adds the
    residual once (a plan with the hidden dim split, run eagerly)."""
    lead, k, n = (1, 2), 128, 512
    args = _mlp_args(lead, k, n, H)
    res = torch.randn(*lead, k, generator=torch.Generator().manual_seed(4)).to(H)
    dispatch_stats.reset("kernel")
    out = torch.ops.spyre.swiglu_mlp_add(*[a.to("spyre") for a in args], res.to("spyre"), 0.3)
    assert dispatch_stats.counts("kernel").get("swiglu_mlp_add") == 1
    want = (res.double() + swiglu(*[a.double() for a in args]) * 0.3).to(H)
    torch.testing.assert_close(out.cpu(), want, **tolerances(H))
    p = kernels.best_swiglu_mlp(1, 2, k, n, k, H, residual=0.3)
    assert next(d for d in p.dims if d.name == "n").cores > 1


def test_residual_swiglu_at_granite_size_keeps_the_plain_tiles():
    """At prefill size the residual tile reuses the activation's LX (dead
    once the hidden blocks are done): same split and tiles as the plain
    program, and only the residual read added to its time."""
    plain = kernels.best_swiglu_mlp(1, 1024, 4096, 12800, 4096)
    res = kernels.best_swiglu_mlp(1, 1024, 4096, 12800, 4096, residual=0.22)
    assert [(d.cores, d.tile) for d in plain.dims] == [(d.cores, d.tile) for d in res.dims]
    tp, tr = estimate(plain).time_s, estimate(res).time_s
    assert tp < tr < tp + 2 * 1024 * 4096 * 2 / HardwareConfig().sustained_bandwidth_Bps


def _rms(h, w, eps=1e-5):
    """transformers' LlamaRMSNorm."""
    f = h.to(torch.float32)
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return w * f.to(h.dtype)


def _layer_tail(norm, proj: bool = True):
    """A decoder layer after attention: the output projection and residual
    add, the norm, the MLP and its residual add (Granite's multipliers);
    ``proj=False``: the stream is ``res + o * 0.22``, no projection."""

    def fn(res, o, wo, nw, wg, wu, wd):
        s = res + (F.linear(o, wo) if proj else o) * 0.22
        return s + swiglu(norm(s, nw), wg, wu, wd) * 0.22

    return fn


def _tail_args(lead, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, wg, wu, wd = _mlp_args(lead, k, n, dtype, seed)
    res = torch.randn(*lead, k, generator=g).to(dtype)
    wo = (torch.randn(k, k, generator=g) / math.sqrt(k)).to(dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    return [res, x, wo, nw, wg, wu, wd]


@pytest.mark.parametrize("lead,dtype", [((1, 64), H), ((2, 8), H), ((40,), torch.float32)], ids=str)
def test_rms_norm_before_the_mlp_is_the_mlp_programs_prologue(lead, dtype):
    """``s + mlp(rms_norm(s))``: the norm runs in LX inside the MLP program
    (``spyre::swiglu_mlp_norm_add``), which reads the residual stream ``s``
    (twice, or once where its tile stays in LX for the add: ``keep_stream``)
    and never the normed activation; ``s`` is a kernel of its own here (an
    add; an output projection before it is the next test).  Two programs,
    no reduction kernel of its own."""
    args = _tail_args(lead, 128, 320, dtype)
    fn = _layer_tail(_rms, proj=False)
    out, ks, fallbacks, prof_fallbacks = _run_compiled(fn, args, dtype)
    ref = fn(*args)  # the CPU in the model's dtype: the roundings the card follows
    torch.testing.assert_close(out.cpu(), ref, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    names = [k.name for k in ks]
    assert len(names) == 2 and names[1].endswith("_res_norm"), names
    assert "mean" not in names[0]
    prog = _program(names[1])
    assert {o.name for o in prog.operands} == {"x", "nw", "wg", "wu", "wd", "out"}
    # the residual stream is read twice (normed, then added) unless its tile
    # is kept in LX (buffer st) for the add; only out stored
    kept = any(b.name == "st" for b in prog.buffers)
    loads = [s.operand for s in prog.steps if getattr(s, "kind", "") == "load"]
    assert loads.count("x") == (1 if kept else 2), (kept, loads)
    assert [s.operand for s in prog.steps if isinstance(s, Store)] == ["out"]


@pytest.mark.parametrize("lead,dtype", [((1, 64), H), ((2, 8), H), ((40,), torch.float32)], ids=str)
def test_output_projection_is_the_mlp_programs_prologue(lead, dtype):
    """``s = res + (o @ wo^T) * c`` then ``s + mlp(rms_norm(s))``: a decoder
    layer's whole second half from its attention output ``o`` is one
    program (``spyre::proj_swiglu_mlp_norm_add``): the projection contracts
    in a loop of its own before the MLP's (``Program.branches``) into the
    accumulator the down projection later uses, and the residual stream
    ``s`` lives only in LX (no operand, never stored)."""
    args = _tail_args(lead, 128, 320, dtype)
    fn = _layer_tail(_rms)
    dispatch_stats.reset("kernel")
    out, ks, fallbacks, prof_fallbacks = _run_compiled(fn, args, dtype)
    torch.testing.assert_close(out.cpu(), fn(*args), **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    names = [k.name for k in ks]
    assert len(names) == 1 and names[0].endswith("_res_norm_oproj128"), names
    assert dispatch_stats.counts("kernel").get("proj_swiglu_mlp_norm_add") == 2
    prog = _program(names[0])
    assert prog.branches
    assert {o.name for o in prog.operands} == {"a", "wo", "res", "nw", "wg", "wu", "wd", "out"}
    assert [s.operand for s in prog.steps if isinstance(s, Store)] == ["out"]


@pytest.mark.parametrize("shape", [(24, 2, 64), (24, 128), (1, 24, 2, 64)], ids=str)
def test_output_projection_reads_the_attention_output_in_place(shape):
    """The op's attention output as vLLM ([T, H, D], [T, H * D]) and
    transformers (token-major [B, S, H, D]) leave it: with D whole sticks
    its bytes are those of the [S, J] or [B, S, J] operand the program
    declares, so it is read where it lies (no d2d re-lay); fp32 against the
    CPU."""
    k, n, j = 128, 320, 128
    g = torch.Generator().manual_seed(4)
    a = torch.randn(*shape, generator=g)
    res = torch.randn(1, 24, k, generator=g)
    wo = torch.randn(k, j, generator=g) / math.sqrt(j)
    nw = 1 + 0.2 * torch.randn(k, generator=g)
    mlp = _mlp_args((1,), k, n, torch.float32, seed=4)[1:]
    args = (res, 0.25, nw, 1e-6, *mlp, 0.5)
    want = torch.ops.spyre.proj_swiglu_mlp_norm_add(a.reshape(1, 24, j), wo, *args)
    dev = [t.to("spyre") if isinstance(t, torch.Tensor) else t for t in (a, wo, *args)]
    dispatch_stats.reset("kernel")
    with profile() as prof:
        out = torch.ops.spyre.proj_swiglu_mlp_norm_add(dev[0].reshape(1, 24, j), *dev[1:])
    assert dispatch_stats.counts("kernel") == {"proj_swiglu_mlp_norm_add": 1}
    assert [t.kind for t in prof.transfers if t.kind == "d2d"] == []
    (kern,) = prof.kernels
    # declared [1, S, J], laid out as the tensor it reads: a 2-D [S, J]'s
    # column sticks outermost, or the token-major default
    lay = _program(kern.name).operand("a").layout
    as_read = (24, j) if len(shape) < 4 else (1, 24, j)
    assert lay.host_size == (1, 24, j)
    assert lay.device_size == SpyreTensorLayout.default(as_read, torch.float32).device_size
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


def test_output_projection_prologue_pays_in_prefill_not_in_decode():
    """Granite-3.3-8B: at 1024 rows the program with the output projection
    (3,821.6 us) beats the projection (514.0 us) and the MLP (3,442.4 us)
    apart, the stream's 8 MiB store and reload gone; in a decode step the
    MLP's split (hidden units over cores) makes the prologue slower than the
    projection's own plan (2,944.5 against 285.5 + 2,648.2 us), so the
    compiler keeps the two kernels (``kernels.swiglu.proj_pays``)."""
    from torch_spyre.kernels.swiglu import proj_pays

    cfg = HardwareConfig()
    shape = (4096, 12800, 4096, H, 0.22, 1e-5, 0.22, cfg)
    assert proj_pays(1, 1024, *shape) and not proj_pays(1, 1, *shape)
    fused = kernels.best_swiglu_mlp(
        1, 1024, 4096, 12800, 4096, residual=0.22, norm_eps=1e-5, proj=(4096, 0.22)
    )
    assert estimate(fused).time_s == pytest.approx(3.82156481443299e-3, rel=1e-9)


def test_a_norm_that_scales_in_fp32_stays_its_own_kernel():
    """Gemma's norm multiplies by ``1 + w`` in fp32 before the cast: another
    computation, not the prologue's; it stays a kernel of its own and the
    MLP program keeps its residual operand."""

    def gemma_norm(h, w, eps=1e-6):
        f = h.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        return (f * (1.0 + w.float())).type_as(h)

    args = _tail_args((1, 16), 128, 320, H)
    fn = _layer_tail(gemma_norm)
    out, ks, fallbacks, _ = _run_compiled(fn, args, H)
    torch.testing.assert_close(out.cpu(), fn(*args), **tolerances(H))
    names = [k.name for k in ks]
    assert fallbacks == {} and names[-1].endswith("_res") and len(names) == 2, names


def test_norm_prologue_with_k_split_over_cores_all_reduces_its_sum_of_squares():
    """A decode row with k over 4 cores: each core squares its band of the
    row, the ring sums the four partials before the rsqrt (run eagerly)."""
    from torch_spyre.ir import Reduce, RingAllReduce

    lead, k, n = (1, 1), 512, 1024
    res, _, _, nw, wg, wu, wd = _tail_args(lead, k, n, H, seed=5)
    dispatch_stats.reset("kernel")
    dev = [a.to("spyre") for a in (res, nw, wg, wu, wd)]
    out = torch.ops.spyre.swiglu_mlp_norm_add(dev[0], dev[1], 1e-6, *dev[2:], 0.5)
    assert dispatch_stats.counts("kernel").get("swiglu_mlp_norm_add") == 1
    want = torch.ops.spyre.swiglu_mlp_norm_add(res, nw, 1e-6, wg, wu, wd, 0.5)  # the CPU
    torch.testing.assert_close(out.cpu(), want, **tolerances(H))
    p = kernels.best_swiglu_mlp(1, 1, k, n, k, H, residual=0.5, norm_eps=1e-6)
    assert next(d for d in p.dims if d.name == "k").cores > 1
    assert any(isinstance(s, Reduce) and s.op == "sumsq" for s in p.steps)
    assert any(isinstance(s, RingAllReduce) and s.buffer == "rs" for s in p.steps)


def test_norm_prologue_at_granite_size_costs_under_a_thousandth_of_the_mlp():
    """Prefill (1024 rows) and decode (1 row) at Granite-3.3-8B's size: the
    norm in LX adds under 0.1% to the MLP program, where the norm kernel it
    replaces took 289.5 us (prefill) and 3.1 us (decode) of its own.  In
    prefill the normed program is even faster (3.442 against 3.512 ms): the
    stream's tile normed in LX stays there for the residual add
    (``keep_stream``), one read of the row block fewer than the plain
    program's separate residual operand."""
    for m in (1024, 1):
        res = estimate(kernels.best_swiglu_mlp(1, m, 4096, 12800, 4096, residual=0.22)).time_s
        normed = kernels.best_swiglu_mlp(1, m, 4096, 12800, 4096, residual=0.22, norm_eps=1e-5)
        assert estimate(normed).time_s < 1.001 * res
        if m == 1024:
            assert any(b.name == "st" for b in normed.buffers)
            assert estimate(normed).time_s < res


# ---------------------------------------------------------------- attention
def _qkv(b, hq, hk, sq, skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, hq, sq, d, generator=g).to(dtype),
        torch.randn(b, hk, skv, d, generator=g).to(dtype),
        torch.randn(b, hk, skv, d, generator=g).to(dtype),
    ]


def _sdpa(mask_kind):
    def fn(q, k, v, *mask):
        gqa = k.shape[1] != q.shape[1]
        if mask_kind == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[0] if mask else None, enable_gqa=gqa
        )

    return fn


def _mask(kind, b, hq, sq, skv, dtype):
    g = torch.Generator().manual_seed(1)
    if kind == "bool":  # padding mask over keys, broadcast over heads
        keep = torch.rand(b, 1, sq, skv, generator=g) > 0.3
        keep[..., 0] = True
        return [keep]
    if kind == "additive":  # per head
        return [torch.randn(b, hq, sq, skv, generator=g).to(dtype)]
    return []


ATTENTION = [
    # b, hq, hk, sq, skv, d, dtype, mask
    (1, 4, 4, 64, 64, 64, H, "causal"),
    (2, 4, 2, 77, 77, 64, H, "causal"),  # GQA, odd length
    (1, 8, 2, 77, 77, 128, torch.float32, "causal"),
    (2, 4, 2, 5, 77, 64, H, "bool"),  # queries against a longer cache
    (1, 4, 2, 1, 77, 64, H, "bool"),  # decode: one query
    (1, 4, 4, 33, 40, 64, torch.float32, "additive"),
    (1, 2, 2, 16, 16, 64, H, "none"),
]


@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: "-".join(map(str, c)))
def test_attention_is_one_flash_program_matching_cpu(case):
    b, hq, hk, sq, skv, d, dtype, mask = case
    args = _qkv(b, hq, hk, sq, skv, d, dtype) + _mask(mask, b, hq, sq, skv, dtype)
    fn = _sdpa(mask)
    out, ks, fallbacks, prof_fallbacks = _run_compiled(fn, args, dtype)
    want = fn(*[a.double() if a.is_floating_point() else a for a in args]).to(dtype)
    torch.testing.assert_close(out.cpu(), want, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    assert len(ks) == 1 and ks[0].name.startswith("flash_attn_"), [k.name for k in ks]
    prog = _program(ks[0].name)
    assert sum(isinstance(s, Matmul) for s in prog.steps) == 2  # q k^T and p v
    assert [s.operand for s in prog.steps if isinstance(s, Store)] == ["out"]


@pytest.mark.parametrize(
    "case",
    [c for c in ATTENTION if c[-1] in ("causal", "bool") and c[3] > 1],
    ids=lambda c: "-".join(map(str, c)),
)
def test_attention_output_is_stored_token_major(case):
    """``sdpa(...).transpose(1, 2).contiguous()`` (what every HF attention
    does before the output projection): the flash program stores the
    [B, S, H, D] layout itself, one program and no permute pass.  (One
    query is a view already: nothing to fuse.)"""
    b, hq, hk, sq, skv, d, dtype, mask = case
    args = _qkv(b, hq, hk, sq, skv, d, dtype) + _mask(mask, b, hq, sq, skv, dtype)
    sdpa = _sdpa(mask)

    def fn(*a):
        return sdpa(*a).transpose(1, 2).contiguous()

    out, ks, fallbacks, prof_fallbacks = _run_compiled(fn, args, dtype)
    want = fn(*[a.double() if a.is_floating_point() else a for a in args]).to(dtype)
    torch.testing.assert_close(out.cpu(), want, **tolerances(dtype))
    assert fallbacks == {} and prof_fallbacks == {}
    assert len(ks) == 1 and ks[0].name.endswith("_bshd"), [k.name for k in ks]
    assert out.shape == (b, sq, hq, d)
    store = next(s for s in _program(ks[0].name).steps if isinstance(s, Store))
    assert store.index == ("b", "q", "h", "g", "d")


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "normed"])
def test_decoder_layer_has_no_relayout_copies(norm):
    """Inductor reuses freed buffers only for the same shape and strides on
    spyre (a buffer keeps the stick layout it was allocated with; reusing
    it in another shape would re-lay every operand through a d2d copy), and
    attention operands are stored contiguous: a llama-style attention
    block + MLP moves no data outside its kernels.  With the norm before
    the MLP, the output projection is the MLP program's prologue, which
    reads the attention's token-major [1, S, H, D] output in place as the
    [1, S, H * D] operand it declares (the same bytes: D is whole sticks)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    s, e, hq, hk, dh, n = 64, 256, 4, 2, 64, 384

    def w(*shape):
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(H)

    ws = [w(hq * dh, e), w(hk * dh, e), w(hk * dh, e), w(e, hq * dh), w(n, e), w(n, e), w(e, n)]
    x = torch.randn(1, s, e, generator=g).to(H)
    nw = (1 + 0.2 * torch.randn(e, generator=g)).to(H)

    def block(x, nw, wq, wk, wv, wo, wg, wu, wd):
        q = F.linear(x, wq).view(1, s, hq, dh).transpose(1, 2)
        k = F.linear(x, wk).view(1, s, hk, dh).transpose(1, 2)
        v = F.linear(x, wv).view(1, s, hk, dh).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + F.linear(a.transpose(1, 2).reshape(1, s, hq * dh), wo)
        return h + swiglu(_rms(h, nw) if norm else h, wg, wu, wd)

    dev = [t.to("spyre") for t in (x, nw, *ws)]
    cf = torch.compile(block, fullgraph=True, dynamic=False)
    cf(*dev)
    with profile() as prof:
        out = cf(*dev)
    want = block(*[t.double() for t in (x, nw, *ws)]).to(H)
    torch.testing.assert_close(out.cpu(), want, **tolerances(H))
    assert [t.kind for t in prof.transfers if t.kind == "d2d"] == []
    names = [k.name for k in prof.kernels]
    tail = "_res_norm_oproj256" if norm else "_res"
    assert any(n.endswith("_bshd") for n in names) and any(n.endswith(tail) for n in names)


def test_eager_sdpa_runs_the_flash_program():
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, H)
    dispatch_stats.reset("fallback")
    with profile() as prof:
        out = F.scaled_dot_product_attention(
            q.to("spyre"), k.to("spyre"), v.to("spyre"), is_causal=True, enable_gqa=True
        )
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out.cpu(), want.to(H), **tolerances(H))
    assert [kk.name for kk in prof.kernels] == ["flash_attn_1x4x24x24x64_causal_gqa2"]
    assert dispatch_stats.counts("fallback") == {}


def test_naive_plan_keeps_the_decomposed_attention():
    args = _qkv(1, 2, 2, 16, 16, 64, H)
    out, ks, *_ = _run_compiled(_sdpa("causal"), args, H, naive=True)
    want = _sdpa("causal")(*[a.float() for a in args]).to(H)
    torch.testing.assert_close(out.cpu(), want, **tolerances(H))
    assert len(ks) > 1 and not any(k.name.startswith("flash_attn") for k in ks)


def test_causal_blocks_above_the_diagonal_are_skipped():
    """The timing model counts only the (query tile, key tile) pairs that run."""
    kw = dict(split=(1, 32, 1, 1), tiles=(128, 128))
    full = estimate(kernels.flash_attention(1, 32, 32, 1024, 1024, 128, mask=None, **kw))
    causal = estimate(kernels.flash_attention(1, 32, 32, 1024, 1024, 128, causal=True, **kw))
    # 8 query tiles x 8 key tiles: 36 of 64 pairs run; K and V are read by them
    kv = 2 * 32 * 1024 * 128 * 2
    q_out = 2 * 32 * 1024 * 128 * 2
    assert full.dram_bytes == pytest.approx(q_out + 8 * kv, rel=0.01)
    assert causal.dram_bytes == pytest.approx(q_out + 8 * kv * 36 / 64, rel=0.01)
    assert causal.time_s < 0.75 * full.time_s
    bad = kernels.flash_attention(1, 2, 2, 64, 64, 64, causal=True)
    dims = tuple(
        Dim(x.name, x.size, x.cores, x.tile, x.chunk, "nope" if x.causal_to else None)
        for x in bad.dims
    )
    with pytest.raises(ValueError, match="causal to 'nope'"):
        type(bad)(bad.name, dims, bad.operands, bad.buffers, bad.steps, bad.loop_order).validate()


def test_grouped_kv_heads_are_read_once_per_group():
    """Granite: 32 query heads over 8 KV heads, timed only."""
    gqa = estimate(kernels.best_flash_attention(1, 32, 8, 1024, 1024, 128, causal=True))
    mha = estimate(kernels.best_flash_attention(1, 32, 32, 1024, 1024, 128, causal=True))
    q_out = 2 * 32 * 1024 * 128 * 2
    assert gqa.dram_bytes < q_out + 2 * 8 * 1024 * 128 * 2 * 1.05
    assert gqa.dram_bytes < 0.7 * mha.dram_bytes
    assert gqa.time_s < mha.time_s


def test_a_long_causal_prompt_shares_the_cores_between_heads_and_positions():
    """Granite at 32k tokens, heads-last output, timed only.  Query heads over
    the cores balance the causal triangle but put a core's writes across the
    whole 256 MiB output (past its span); positions alone leave the core with
    the last quarter 7/8 of a quarter square of work.  Two heads x two halves
    is the fastest plan that fits."""
    from torch_spyre.ir import SpanError

    shape = (1, 32, 8, 32768, 32768, 128)
    best = kernels.best_flash_attention(*shape, causal=True, heads_last=True)
    dims = {d.name: d.cores for d in best.dims}
    assert (dims["g"], dims["q"]) == (2, 2)
    by_position = kernels.flash_attention(
        *shape, causal=True, heads_last=True, split=(1, 8, 1, 4), tiles=(128, 128)
    )
    assert estimate(best).time_s < 0.9 * estimate(by_position).time_s
    by_head = kernels.flash_attention(
        *shape, causal=True, heads_last=True, split=(1, 8, 4, 1), tiles=(128, 128)
    )
    with pytest.raises(SpanError, match="span"):
        by_head.validate(HardwareConfig())


def _run_tile_by_tile(prog, host):
    """Run a flash-attention program as the card would: the steps of the key
    loop once per key tile, a contraction over the key dim adding into (sum)
    or maxing with (max) the buffer's running value from the second tile on.
    ``host``: operand name -> host tensor.  Returns the output (host)."""
    from dataclasses import replace

    from torch_spyre.ir import Load
    from torch_spyre.sim import executor as ex

    dev = {
        o.name: o.layout.to_device(host[o.name].reshape(o.layout.host_size)).contiguous()
        for o in prog.operands
        if o.name in host
    }
    out = prog.operand("out").layout
    dev["out"] = torch.zeros(out.device_size, dtype=out.dtype)
    kv = prog.dim("kv")
    env: dict = {}
    axes: dict = {}  # env buffer -> its axes
    inner = [s for s in prog.steps if "kv" in s.loops]
    first, last = prog.steps.index(inner[0]), prog.steps.index(inner[-1])
    outer_before, outer_after = prog.steps[:first], prog.steps[last + 1 :]

    def run(p, steps, accumulate):
        for s in steps:
            out = getattr(s, "out", None)
            old, old_axes = env.get(out), axes.get(out)
            ex.build_step(p, s, axes)(dev, env)
            contracts = s.kind in ("matmul", "reduce") and "kv" not in p.buffer(s.out).dims
            if accumulate and contracts:
                prev = ex._Align(old_axes, axes[out])(old)
                comb = torch.maximum if getattr(s, "op", "sum") == "max" else torch.add
                env[out] = comb(prev.float(), env[out].float()).to(env[out].dtype)

    run(prog, outer_before, False)
    for j, start in enumerate(range(0, kv.size, kv.tile_size)):
        n = min(kv.tile_size, kv.size - start)
        dims = tuple(replace(d, size=n, tile=None) if d.name == "kv" else d for d in prog.dims)
        steps = tuple(
            replace(s, offsets=tuple(start if x == "kv" else 0 for x in s.index))
            if isinstance(s, Load) and "kv" in s.index
            else s
            for s in inner
        )
        p = replace(prog, dims=dims, steps=steps)
        run(p, steps, accumulate=j > 0)
    run(prog, outer_after, False)
    return out.to_host(dev["out"].view(out.device_size))


@pytest.mark.parametrize("causal", [True, False])
def test_online_softmax_is_right_tile_by_tile(causal):
    """The whole-space executor cannot tell a wrong rescale (it sees every key
    at once); running the key loop tile by tile, as the card does, can."""
    from torch_spyre.ir import Vector

    b, hq, hk, s, d = 1, 4, 2, 45, 64
    q, k, v = _qkv(b, hq, hk, s, s, d, torch.float32)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(b, 1, s, s, generator=g) > 0.4
    keep[..., 0] = True
    mask = None if causal else ((b, 1, s, s), torch.bool)
    prog = kernels.flash_attention(
        b,
        hq,
        hk,
        s,
        s,
        d,
        torch.float32,
        causal=causal,
        mask=mask,
        split=(1, 1, 1, 1),
        tiles=(s, 16),
    )
    host = {"q": q, "k": k, "v": v, "qpos": torch.arange(s) * 1.0, "kvpos": torch.arange(s) * 1.0}
    if not causal:
        host["mask"] = keep
    got = _run_tile_by_tile(prog, host).reshape(b, hq, s, d)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if causal else keep, is_causal=causal, enable_gqa=True
    )
    torch.testing.assert_close(got, want, **tolerances(torch.float32))
    # without the rescale of the running output the tiles disagree
    broken = tuple(
        st for st in prog.steps if not (isinstance(st, Vector) and st.out == "o" and st.op == "mul")
    )
    from dataclasses import replace

    bad = _run_tile_by_tile(replace(prog, steps=broken), host).reshape(b, hq, s, d)
    assert not torch.allclose(bad, want, atol=1e-2)
