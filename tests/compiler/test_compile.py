"""torch.compile on spyre tensors: the Inductor backend plans kernel programs.

Compiles are slow on 2 cores, so every model is compiled once per session
(``_compiled``) and shared by the tests that look at it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.compiler import lowering, scheduling, views
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import tolerances

H = torch.float16
TOL = tolerances(H)


# --------------------------------------------------------------- the models
def mlp_gelu(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def mlp_silu(x, w1, b1, w2, b2):
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def swiglu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def softmax(x):
    return torch.softmax(x, -1)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def rope(x, cos, sin):
    return x * cos + torch.cat((-x[..., 32:], x[..., :32]), -1) * sin


def _inputs():
    g = torch.Generator().manual_seed(0)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(H)

    x = r(2, 16, 128)
    return {
        "mlp_gelu": (
            mlp_gelu,
            (x, r(256, 128, scale=0.05), r(256), r(128, 256, scale=0.05), r(128)),
        ),
        "mlp_silu": (
            mlp_silu,
            (x, r(256, 128, scale=0.05), r(256), r(128, 256, scale=0.05), r(128)),
        ),
        "swiglu": (
            swiglu,
            (x, r(256, 128, scale=0.05), r(256, 128, scale=0.05), r(128, 256, scale=0.05)),
        ),
        "rmsnorm": (rmsnorm, (x, r(128))),
        "layernorm": (layernorm, (x, r(128), r(128))),
        "softmax": (softmax, (r(4, 16, 96),)),
        "sdpa": (sdpa, (r(1, 4, 16, 64), r(1, 4, 16, 64), r(1, 4, 16, 64))),
        "sdpa_causal": (sdpa_causal, (r(1, 4, 16, 64), r(1, 4, 16, 64), r(1, 4, 16, 64))),
        "rope": (rope, (r(1, 4, 16, 64), r(16, 64), r(16, 64))),
        "sdpa_gqa_causal": (sdpa_gqa, (r(1, 4, 16, 64), r(1, 2, 16, 64), r(1, 2, 16, 64))),
    }


MODELS = _inputs()
_cache: dict[str, tuple] = {}


def _compiled(name: str):
    """(compiled fn, spyre inputs, CPU reference, output of the first call,
    fallbacks during it, profile of a second call)."""
    if name not in _cache:
        fn, args = MODELS[name]
        cf = torch.compile(fn, fullgraph=True, dynamic=False)
        dev = [a.to("spyre") for a in args]
        dispatch_stats.reset("fallback")
        out = cf(*dev)
        fallbacks = dispatch_stats.counts("fallback")
        with profile() as prof:
            cf(*dev)
        ref = fn(*[a.float() for a in args]).to(H)
        _cache[name] = (cf, dev, ref, out, fallbacks, prof)
    return _cache[name]


# --------------------------------------------------------------------- tests
def test_backend_is_registered_through_the_public_hooks():
    torch_spyre.compiler.register()
    from torch._dynamo.device_interface import get_interface_for_device
    from torch._inductor.codegen.common import (
        custom_backend_passes,
        get_device_op_overrides,
        get_scheduling_for_device,
        get_wrapper_codegen_for_device,
    )

    assert get_scheduling_for_device("spyre") is scheduling.SpyreScheduling
    assert get_wrapper_codegen_for_device("spyre") is scheduling.SpyreWrapperCodegen
    props = get_interface_for_device("spyre").get_device_properties(0)
    assert props.cores == 32 and props.lx_bytes == 2 * 1024 * 1024
    assert get_device_op_overrides("spyre").synchronize() == "torch.spyre.synchronize()"
    # the FX graph cache key includes our version and source hash
    uuid = custom_backend_passes["spyre"].uuid()
    assert torch_spyre.compiler.backend_version() in uuid
    assert uuid.split("+")[0].endswith(torch_spyre.__version__)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_compiles_and_matches_cpu_without_host_fallback(name):
    _, _, ref, out, fallbacks, prof = _compiled(name)
    assert out.device.type == "spyre"
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    assert fallbacks == {}
    assert prof.fallbacks == {}
    assert prof.kernels and all(k.time_s > 0 for k in prof.kernels)


def test_fused_kernels_appear_in_the_profile():
    *_, prof = _compiled("softmax")
    # amax, exp, sum and div: one kernel program, intermediates in LX
    assert len(prof.kernels) == 1
    assert prof.kernels[0].name.startswith("fused_")
    *_, prof = _compiled("layernorm")
    assert len(prof.kernels) == 1


def test_matmul_epilogue_is_fused():
    *_, prof = _compiled("mlp_gelu")
    names = [k.name for k in prof.kernels]
    # addmm + bias + GELU in one PE-array program, then the second addmm
    assert len(names) == 2, names
    assert names[0].startswith("fused_mm_")
    *_, prof = _compiled("swiglu")
    # gate and up projections, silu * up and the down projection: one program
    assert [k.name for k in prof.kernels] == ["swiglu_mlp_32x128x256x128"]


def test_compiled_mlp_is_faster_than_eager_op_by_op():
    fn, args = MODELS["mlp_gelu"]
    _, dev, *_, prof = _compiled("mlp_gelu")
    with profile() as eager:
        fn(*dev)
    compiled_s = sum(k.time_s for k in prof.kernels)
    eager_s = sum(k.time_s for k in eager.kernels)
    assert len(eager.kernels) == 3
    assert compiled_s < eager_s


@pytest.mark.slow  # a cold CPU compile builds C++ (~20 s on 2 cores)
def test_cache_key_changes_with_the_backend_version(monkeypatch):
    from torch_spyre.compiler.passes import SpyreGraphPass
    from torch_spyre.runtime.artifact_cache import code_version as version

    before = SpyreGraphPass().uuid()
    monkeypatch.setattr(torch_spyre._version, "__version__", "9.9.9")
    version.cache_clear()  # computed once per process: what a new release's process sees
    try:
        after = SpyreGraphPass().uuid()
    finally:
        version.cache_clear()
    assert before != after and "9.9.9+" in after


def test_a_graph_from_the_fx_graph_cache_models_what_the_fresh_compile_did():
    """Inductor's FX graph cache replays a graph with its constants unpickled
    into linear storages (RoPE's lane-shuffle table here).  They are laid out
    once, on their first use, so the replayed graph then runs the same kernels
    and transfers and models the same time as the fresh compile (a re-lay of
    each constant on every call was 0.4% more time per SmolLM2 decode token)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    fn, args = MODELS["rope"]
    dev = [a.to("spyre") for a in args]
    runs = []
    with fresh_cache():
        for _ in range(2):  # a miss that fills the cache, then a hit
            torch._dynamo.reset()
            counters.clear()
            cf = torch.compile(fn, fullgraph=True, dynamic=False)
            cf(*dev)
            with profile() as prof:
                out = cf(*dev)
            hits = counters["inductor"]["fxgraph_cache_hit"]
            runs.append((hits, prof.total_time_s, [t.kind for t in prof.transfers], out.cpu()))
    torch._dynamo.reset()
    (hit0, t0, tr0, out0), (hit1, t1, tr1, out1) = runs
    assert (hit0, hit1) == (0, 1)
    assert t1 == t0 and tr1 == tr0 == []
    assert torch.equal(out1, out0)


def test_cpu_compile_in_the_same_process_is_unaffected():
    _compiled("softmax")
    f = torch.compile(lambda a: torch.softmax(a * 2, -1), fullgraph=True)
    a = torch.randn(8, 32)
    torch.testing.assert_close(f(a), torch.softmax(a * 2, -1))


def test_automatic_dynamic_specialises_and_recompiles(caplog):
    def f(x, w):
        return F.silu(x) * w + 1

    cf = torch.compile(f, fullgraph=True)
    w = torch.randn(64, dtype=H)
    # the line is logged when the graph is planned (an FX-cache hit replays silently)
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)
    with no_cache, caplog.at_level("WARNING", logger="torch_spyre.compiler"):
        for n in (8, 16, 24):
            x = torch.randn(n, 64, dtype=H)
            out = cf(x.to("spyre"), w.to("spyre"))
            torch.testing.assert_close(out.cpu(), f(x.float(), w.float()).to(H), **TOL)
    lines = [
        r.getMessage() for r in caplog.records if "specialising dynamic size" in r.getMessage()
    ]
    assert lines and all("recompiles" in m for m in lines)


def test_automatic_dynamic_in_place_update_of_an_input_compiles():
    """An in-place update of a graph input (stored through the input's buffer)
    under automatic dynamic shapes: its size is specialised like any other
    (it once aborted the compile: int() of a symbolic size).  fp32: tight."""

    def f(x, w):
        x.add_(x @ w)
        return x.sum()

    cf = torch.compile(f, fullgraph=True)
    w = torch.randn(64, 64) / 8
    for n in (8, 16, 24):
        x = torch.randn(n, 64)
        want = x.clone()
        want_sum = f(want, w)
        dx = x.to("spyre")
        got_sum = cf(dx, w.to("spyre"))
        torch.testing.assert_close(dx.cpu(), want)
        torch.testing.assert_close(got_sum.cpu(), want_sum)


def _fresh_plans(fn, *args):
    """The kernel plans of compiling ``fn`` (FX graph cache off: plan, don't replay)."""
    scheduling.PLANS.clear()  # bounded: a trim during this compile would hide its plans
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(fn, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])
    return out, list(scheduling.PLANS)


def test_plan_keeps_intermediates_in_lx_and_reuses_buffers():
    x, w, b = (torch.randn(8, 192, dtype=H), torch.randn(192, dtype=H), torch.randn(192, dtype=H))
    out, plans = _fresh_plans(layernorm, x, w, b)
    torch.testing.assert_close(out.cpu(), layernorm(x.float(), w.float(), b.float()).to(H), **TOL)
    (plan,) = plans
    prog = plan.program
    # loads of x, w, b; one store of the output: mean/rstd never leave the LX
    assert [s.kind for s in prog.steps].count("store") == 1
    assert [s.kind for s in prog.steps].count("load") == 3
    computed = [s for s in prog.steps if s.kind in ("vector", "reduce")]
    assert len(prog.buffers) < len(computed)  # LX buffers reused by liveness
    assert sum(prog.lx_usage().values()) <= 1024 * 1024  # half the LX: double buffering fits
    assert prog.cores_used == 8  # one row per core


def test_mlp_plan_is_one_pe_array_program_with_its_epilogue():
    _, (w1, b1, w2, b2) = MODELS["mlp_gelu"][1][0], MODELS["mlp_gelu"][1][1:]
    x = torch.randn(32, 128, dtype=H)
    out, plans = _fresh_plans(mlp_gelu, x, w1, b1, w2, b2)
    ref = mlp_gelu(x.float(), w1.float(), b1.float(), w2.float(), b2.float()).to(H)
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    fused = [p for p in plans if p.program.name.startswith("fused_mm_")]
    assert len(fused) == 1
    kinds = [s.kind for s in fused[0].program.steps]
    assert "matmul" in kinds and kinds.count("store") == 1
    assert any(getattr(s, "op", "") == "erf" for s in fused[0].program.steps)


def test_unplannable_op_degrades_with_a_message_naming_it(spyre_settings):
    # an op the planner has no program step for (atan2: binary, not one of the
    # vector unit's ops; unary aten ops are, lowering.aten_unary) fused into a
    # pointwise group: the node runs as eager kernels (degrade.py), with a
    # warning naming the op; compile_fallback=error refuses it
    from torch_spyre.compiler.degrade import SpyreCompileWarning

    def f(x):
        return torch.atan2(x * 2, x + 3) + 1

    x = torch.randn(5, 70, dtype=H)
    torch._dynamo.reset()
    with pytest.warns(SpyreCompileWarning, match="runs as eager kernels: op 'atan2'"):
        got = torch.compile(f, fullgraph=True, dynamic=False)(x.to("spyre"))
    torch.testing.assert_close(got.cpu().float(), f(x.float()), **tolerances(H))
    torch._dynamo.reset()
    spyre_settings(compile_fallback="error")
    with pytest.raises(Exception, match="runs as eager kernels: op 'atan2'"):
        torch.compile(f, fullgraph=True, dynamic=False)(x.to("spyre"))


def test_cat_along_an_outer_dim_is_a_dma_program(spyre_settings):
    # a KV cache grown by a token (FMS's torch.cat((cache, k), dim=2)) and an
    # attention-sink column after a wide row (gpt-oss): the device's cat
    # (passes.py), no degrade step
    spyre_settings(compile_fallback="error")

    def grow(cache, k, logits, sink):
        return torch.cat((cache, k * 2), dim=2), torch.cat([logits, sink], dim=-1).softmax(-1)

    g = torch.Generator().manual_seed(3)
    args = [
        torch.randn(s, generator=g, dtype=H)
        for s in ((1, 2, 9, 64), (1, 2, 1, 64), (1, 2, 3, 1100), (1, 2, 3, 1))
    ]
    torch._dynamo.reset()
    got = torch.compile(grow, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])
    for o, w in zip(got, grow(*[a.float() for a in args])):
        torch.testing.assert_close(o.cpu().float(), w, **tolerances(H))


def test_cat_of_computed_pieces_along_the_stick_dim_is_a_lane_scatter():
    def shuffle(x):
        return torch.cat((x[..., 32:] * 2, x[..., :32].exp()), -1)

    x = torch.randn(4, 64, dtype=H)
    got = torch.compile(shuffle, fullgraph=True, dynamic=False)(x.to("spyre"))
    torch.testing.assert_close(got.cpu().float(), shuffle(x.float()), **tolerances(H))


def test_constant_fills_are_kernels():
    # torch.full / zeros_like inside a graph (causal masks, caches): a store of a
    # constant broadcast over the output, planned like any other program
    def f(x):
        return x + torch.full((4, 70), 2.5, device=x.device) + torch.zeros_like(x)

    x = torch.randn(4, 70)
    before = dict(dispatch_stats.counts("fallback"))
    y = torch.compile(f, fullgraph=True, dynamic=False)(x.to("spyre"))
    torch.testing.assert_close(y.cpu(), f(x))
    assert dispatch_stats.counts("fallback") == before


def test_gather_by_a_device_index_runs_on_the_card():
    # a paged-KV page read (spyre-inference's attention): index_select by a
    # one-element device index, then a matmul with the page
    def f(q, pages, table):
        page = pages.index_select(0, table[1, 0:1]).squeeze(0)
        return q @ page.transpose(0, 1)

    q, pages = torch.randn(4, 64), torch.randn(6, 16, 64)
    table = torch.zeros(2, 32, dtype=torch.int32)
    table[1, 0] = 4
    before = dict(dispatch_stats.counts("fallback"))
    y = torch.compile(f, fullgraph=True, dynamic=False)(
        q.to("spyre"), pages.to("spyre"), table.to("spyre")
    )
    torch.testing.assert_close(y.cpu(), f(q, pages, table), **tolerances(torch.float32))
    assert dispatch_stats.counts("fallback") == before


def test_rope_by_2x2_rotation_of_a_fused_qkv_compiles():
    # IBM's RoPE (spyre-inference, hf-adapters): the halves of every head of a
    # split QKV are read as every other block of sticks (a gap in the index)
    def rotate(x, rot):
        pairs = x.view(x.shape[0], -1, 2, 64)
        return (rot.unsqueeze(1) * pairs.unsqueeze(-3)).sum(dim=-2).flatten(-2).view(x.shape)

    def f(qkv, rot):
        q, k, _ = qkv.split([256, 128, 128], dim=-1)
        return rotate(q, rot), rotate(k.contiguous(), rot)

    qkv, rot = torch.randn(5, 512, dtype=H), torch.randn(5, 2, 2, 64, dtype=H)
    before = dict(dispatch_stats.counts("fallback"))
    out = torch.compile(f, fullgraph=True, dynamic=False)(qkv.to("spyre"), rot.to("spyre"))
    for got, want in zip(out, f(qkv.float(), rot.float())):
        torch.testing.assert_close(got.cpu().float(), want, **tolerances(H))
    assert dispatch_stats.counts("fallback") == before


def test_kv_cache_update_in_place_runs_on_the_card():
    # a static KV cache: index_copy_ into a graph input (an indirect store, run by
    # the eager DMA kernel through spyre::index_put_) and a kernel reading it after;
    # the cache is written in place: no copy of it, no copy back
    def f(cache, pos, v):
        cache.index_copy_(0, pos, v)
        return cache * 2

    c, pos, v = torch.zeros(8, 64), torch.tensor([2, 5]), torch.randn(2, 64)
    cs, dpos, dv = c.to("spyre"), pos.to("spyre"), v.to("spyre")
    before = dict(dispatch_stats.counts("fallback"))
    cf = torch.compile(f, fullgraph=True, dynamic=False)
    out = cf(cs, dpos, dv)
    torch.testing.assert_close(out.cpu(), f(c.clone(), pos, v))
    torch.testing.assert_close(cs.cpu(), c.index_copy(0, pos, v))
    assert dispatch_stats.counts("fallback") == before
    with profile() as prof:
        cf(cs, dpos, dv)
    assert [t.kind for t in prof.transfers] == []
    assert len(prof.kernels) == 2 and "copy" not in prof.kernels[1].name, prof.kernels


def test_rope_is_a_permutation_matmul_with_a_fused_epilogue():
    *_, prof = _compiled("rope")
    names = [k.name for k in prof.kernels]
    assert len(names) == 1 and names[0].startswith("fused_mm_"), names


def test_embedding_runs_the_device_kernel_inside_the_compiled_region():
    def embed(ids, table, pos, w, b):
        return layernorm(F.embedding(ids, table) + pos, w, b)

    ids = torch.randint(0, 100, (2, 16))
    args = (torch.randn(100, 128, dtype=H), torch.randn(16, 128, dtype=H))
    args += (torch.randn(128, dtype=H), torch.randn(128, dtype=H))
    cf = torch.compile(embed, fullgraph=True, dynamic=False)
    dispatch_stats.reset("fallback")
    out = cf(ids.to("spyre"), *[a.to("spyre") for a in args])
    assert dispatch_stats.counts("fallback") == {}
    ref = embed(ids, *[a.float() for a in args]).to(H)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_whole_tensor_reductions_and_rows_longer_than_the_lx():
    x = torch.randn(30, 70, dtype=H)
    cf = torch.compile(lambda x: x.float().pow(2).sum() * 0.5, fullgraph=True, dynamic=False)
    out = cf(x.to("spyre"))
    assert out.shape == ()
    torch.testing.assert_close(out.cpu(), x.float().pow(2).sum() * 0.5, rtol=1e-4, atol=1e-3)
    # 4096 x 1024 fp16 per split of Inductor's split reduction: streamed through the LX
    y = torch.randn(4096, 1024, dtype=H)
    cf = torch.compile(lambda y: y.amax(), fullgraph=True, dynamic=False)
    assert cf(y.to("spyre")).cpu() == y.amax()


def test_debug_dump(spyre_settings, capsys):
    spyre_settings(debug=True)
    cf = torch.compile(lambda a: torch.tanh(a) * 3 - 1, fullgraph=True, dynamic=False)
    a = torch.randn(40, 72, dtype=H)
    torch.testing.assert_close(
        cf(a.to("spyre")).cpu(), (torch.tanh(a.float()) * 3 - 1).to(H), **TOL
    )
    out = capsys.readouterr().out
    assert "kernel fused_" in out and "grid" in out and "lx total" in out


def test_decompose_index_and_view_layouts():
    import sympy

    a, b, c = sympy.symbols("a b c")
    r = {"a": 4, "b": 16, "c": 64}
    assert views._decompose(a * 1024 + b * 64 + c, (64, 64), (64, 1), 0, r, "t") == (
        [["a", "b"], ["c"]],
        [0, 0],
    )
    # the k slice of a fused qkv projection: heads x head_dim at column 256
    r = {"a": 4, "b": 64, "c": 32}
    got = views._decompose(64 * a + b + 768 * c + 256, (32, 768), (768, 1), 0, r, "t")
    assert got == ([["c"], ["a", "b"]], [0, 256])
    lay, start = views.view_layout((32, 768), H, [[32], [4, 64]], [0, 256])
    assert lay.host_size == (32, 4, 64) and lay.device_size == (4, 1, 32, 64)
    assert start == 4 * 32 * 64  # sticks 4..7 of every row: one contiguous block
    lay, start = views.view_layout((64, 64), H, [[4, 16], [64]])
    assert lay.host_size == (4, 16, 64) and lay.device_size == (1, 4, 16, 64) and start == 0
    with pytest.raises(lowering.Unsupported, match="whole sticks"):
        views.view_layout((32, 768), H, [[32], [32]], [0, 16])
    with pytest.raises(lowering.Unsupported, match="not contiguous"):
        views.view_layout((4, 32, 64), H, [[2], [32], [64]], [1, 0, 0])


def _blocks():
    import benchmark_module

    return benchmark_module.load("compile_blocks")


@pytest.mark.slow  # compiles each block for spyre and for CPU
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_transformer_block_compiles_matches_cpu_and_beats_eager(kind):
    mod = _blocks()
    torch.manual_seed(0)
    block = (mod.LlamaBlock if kind == "llama" else mod.BertLayer)(128, 2, 256)
    x = torch.randn(1, 16, 128, dtype=H)
    mod.warm_up()
    row = mod.run(kind, block, x)
    assert row["fallbacks"] == {}
    assert row["max_err"] < 2e-2
    assert row["compiled_kernels"] < row["eager_kernels"]
    assert row["compiled_us"] < row["eager_us"]
    # compile time (issue 5, item 6: target 2x CPU Inductor): a same-run
    # ratio, with wide slack: wall clock on a shared 2-core machine (measured 1.2-1.9x)
    assert row["compile_spyre_s"] < 6 * row["compile_cpu_s"]
