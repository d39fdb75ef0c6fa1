"""Pins the kernel benchmark (benchmarks/kernels.py, issue 6).

Every case is compiled through the real compiler path (torch.compile,
fullgraph) under the optimised and the naive planning options and timed, not
executed (``torch_spyre.sim.timing_only``): modelled figures are
deterministic, so they are pinned tightly, and a plan that gets slower (or a
target that was met and no longer is) fails.  A small-size run checks that the
same plans compute the right values.

If a deliberate change of the planner or the timing model moves a figure,
rerun ``python benchmarks/kernels.py``, update docs/performance.md and the
figures below together, and say why in the change.
"""

from __future__ import annotations

import math

import benchmark_module
import pytest
import torch

from torch_spyre.compiler import scheduling
from torch_spyre.ir import RingAllReduce
from torch_spyre.kernels import options
from torch_spyre.sim import timing_only

B = benchmark_module.load("kernels")

#: modelled microseconds of the (optimised, naive) plans; the SwiGLU MLP also
#: unfused.  Regenerate with benchmarks/kernels.py (see the module docstring).
#: A case's time includes the device copies its graph launches (issue 28: the
#: window gathers); that moved the naive softmax, norm and attention plans,
#: whose restickify copies were left out before (2-5% more), not the
#: optimised ones.
PINNED_US: dict[str, dict[str, float]] = {
    "prefill M=512 K=4096 N=4096": {"optimised": 366.24, "naive": 9213.71},
    "prefill M=512 K=4096 N=1024": {"optimised": 123.10, "naive": 2305.96},
    "prefill M=512 K=4096 N=12800": {"optimised": 1052.05, "naive": 28806.45},
    "prefill M=512 K=12800 N=4096": {"optimised": 1048.71, "naive": 28710.03},
    "prefill M=1024 K=4096 N=4096": {"optimised": 442.41, "naive": 9391.02},
    "prefill M=1024 K=4096 N=1024": {"optimised": 170.30, "naive": 2351.31},
    "prefill M=1024 K=4096 N=12800": {"optimised": 1205.80, "naive": 29375.18},
    "prefill M=1024 K=12800 N=4096": {"optimised": 1203.77, "naive": 29186.45},
    "decode GEMV K=4096 N=4096": {"optimised": 285.31, "naive": 310.55},
    "decode GEMV K=4096 N=12800": {"optimised": 884.84, "naive": 968.00},
    "decode GEMV K=4096 N=49152": {"optimised": 3386.46, "naive": 3543.36},
    "softmax 512x1024 1 core": {"optimised": 43.05, "naive": 83.10},
    "softmax 512x1024 32 cores": {"optimised": 20.62, "naive": 50.82},
    "softmax 4096x2048 32 cores": {"optimised": 287.57, "naive": 630.38},
    "RMSNorm 1024x4096": {"optimised": 147.52, "naive": 227.23},
    "LayerNorm 1024x4096": {"optimised": 150.42, "naive": 311.42},
    "SwiGLU MLP 4096->12800->4096 M=512": {
        "optimised": 2764.17,
        "unfused": 3489.23,
        "naive": 86660.29,
    },
    "attention 32x128 heads, 1024 tokens, causal": {"optimised": 311.55, "naive": 17700.76},
    # fp8 weights (issue 17): half the GEMV time of fp16; W8A8 at the 8-bit PE rate
    "decode GEMV W8A16 K=4096 N=4096": {"optimised": 146.59, "naive": 738.86},
    "decode GEMV W8A16 K=4096 N=12800": {"optimised": 448.80, "naive": 2301.75},
    "prefill W8A16 M=1024 K=4096 N=4096": {"optimised": 361.92, "naive": 9819.32},
    "prefill W8A8 M=1024 K=4096 N=4096": {"optimised": 262.03, "naive": 4733.58},
    "prefill W8A16 M=1024 K=4096 N=12800": {"optimised": 1105.27, "naive": 30708.94},
    "prefill W8A8 M=1024 K=4096 N=12800": {"optimised": 721.42, "naive": 14800.84},
    # convolution and pooling (issue 28): the window gather (a device copy) and
    # one matmul / reduction program; one plan either way (eager programs).
    # The conv was 1114.01 us through aten.convolution, whose Inductor lowering
    # made the input and weights channels-last and split off the bias; routed
    # to spyre::convolution (compiler/conv_routes.py) it is 939.83 us
    "conv2d 3x3 64->64 56x56 N=8": {"optimised": 939.83, "naive": 939.83},
    "max_pool2d 3x3/2 64x112x112 N=8": {"optimised": 1775.26, "naive": 1775.26},
}

#: targets met today (case, target): a regression that loses one fails
MET: set[tuple[str, str]] = {
    ("prefill M=512 K=4096 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=512 K=4096 N=4096", "less time than naive"),
    ("prefill M=512 K=4096 N=1024", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=512 K=4096 N=1024", "less time than naive"),
    ("prefill M=512 K=4096 N=12800", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=512 K=4096 N=12800", "less time than naive"),
    ("prefill M=512 K=12800 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=512 K=12800 N=4096", "less time than naive"),
    ("prefill M=1024 K=4096 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=1024 K=4096 N=4096", "less time than naive"),
    ("prefill M=1024 K=4096 N=1024", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=1024 K=4096 N=1024", "less time than naive"),
    ("prefill M=1024 K=4096 N=12800", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=1024 K=4096 N=12800", "less time than naive"),
    ("prefill M=1024 K=12800 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill M=1024 K=12800 N=4096", "less time than naive"),
    ("decode GEMV K=4096 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("decode GEMV K=4096 N=12800", "sustained LPDDR5 bw (memory-bound)"),
    ("decode GEMV K=4096 N=49152", "sustained LPDDR5 bw (memory-bound)"),
    ("softmax 512x1024 1 core", "less time than naive"),
    ("softmax 512x1024 32 cores", "less time than naive"),
    ("softmax 4096x2048 32 cores", "sustained LPDDR5 bw (memory-bound)"),
    ("softmax 4096x2048 32 cores", "less time than naive"),
    ("RMSNorm 1024x4096", "sustained LPDDR5 bw (memory-bound)"),
    ("LayerNorm 1024x4096", "sustained LPDDR5 bw (memory-bound)"),
    # one program: gate and up sharing x, epilogue and down projection in LX
    ("SwiGLU MLP 4096->12800->4096 M=512", "sustained LPDDR5 bw (memory-bound)"),
    ("SwiGLU MLP 4096->12800->4096 M=512", "fused: less time than unfused"),
    # one flash-attention program
    ("attention 32x128 heads, 1024 tokens, causal", "sustained LPDDR5 bw (memory-bound)"),
    ("decode GEMV W8A16 K=4096 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("decode GEMV W8A16 K=4096 N=4096", "less time than naive"),
    ("decode GEMV W8A16 K=4096 N=12800", "sustained LPDDR5 bw (memory-bound)"),
    ("decode GEMV W8A16 K=4096 N=12800", "less time than naive"),
    ("prefill W8A16 M=1024 K=4096 N=4096", "PE peak (compute-bound)"),
    ("prefill W8A16 M=1024 K=4096 N=4096", "less time than naive"),
    ("prefill W8A8 M=1024 K=4096 N=4096", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill W8A8 M=1024 K=4096 N=4096", "less time than naive"),
    ("prefill W8A16 M=1024 K=4096 N=12800", "PE peak (compute-bound)"),
    ("prefill W8A16 M=1024 K=4096 N=12800", "less time than naive"),
    # issue 30: activation-stationary tiles (a core's rows of x loaded once,
    # whole k, while the weight's column tiles stream past): 82.9% and 84.7%
    # of the roof before, 97.0% and 96.3% now
    ("prefill W8A8 M=1024 K=4096 N=12800", "sustained LPDDR5 bw (memory-bound)"),
    ("prefill W8A8 M=1024 K=4096 N=12800", "less time than naive"),
}

REL = 1e-3  # the model is deterministic; leave room for float summation order


@pytest.fixture(scope="module", autouse=True)
def _plan_afresh():
    """Every compile here plans (an FX graph cache hit would skip the planner)."""
    old = torch._inductor.config.fx_graph_cache
    torch._inductor.config.fx_graph_cache = False
    yield
    torch._inductor.config.fx_graph_cache = old


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in B.run()}


def test_every_case_is_benchmarked(results):
    assert set(results) == set(PINNED_US)
    for name, r in results.items():
        assert set(r.plans) == set(PINNED_US[name]), name


@pytest.mark.parametrize("name", sorted(PINNED_US))
def test_modelled_times_are_pinned(results, name):
    r = results[name]
    for mode, want in PINNED_US[name].items():
        got = r.plans[mode].time_us
        assert got == pytest.approx(want, rel=REL), f"{name} ({mode}): {got:.1f} us, pinned {want}"


def test_targets_met_stay_met(results):
    met = {(r.name, t["target"]) for r in results.values() for t in r.targets if t["met"]}
    assert MET <= met, f"targets no longer met: {sorted(MET - met)}"
    # and the table says which unit limits every missed one
    for r in results.values():
        for t in r.targets:
            if not t["met"]:
                assert r.plans["optimised"].bottleneck in ("compute", "memory", "ring", "overhead")


def test_roofline_and_attainment_are_consistent(results):
    for r in results.values():
        t = r.plans["optimised"].time_us
        assert r.roof_us == pytest.approx(max(r.roof_pe_us, r.roof_mem_us, r.roof_vec_us))
        assert r.attainment == pytest.approx(r.roof_us / t)
        # no plan beats the roofline; memory-bound figures never pass the
        # calibrated sustained bandwidth (dram_efficiency of the peak)
        assert r.attainment <= 1.0
        assert r.bw_of_peak <= 0.582 + 1e-9
        assert r.roof_mem_peak_us == pytest.approx(r.roof_mem_us * 0.582, rel=1e-6)


def test_naive_plans_are_real_plans(results):
    """Naive: no fusion (more kernels where the optimised plan fuses), matmul
    rows over the cores and every weight streamed by every core."""
    sm = results["softmax 4096x2048 32 cores"].plans
    assert sm["naive"].kernels > sm["optimised"].kernels == 1
    mm = results["prefill M=512 K=4096 N=4096"].plans
    # each of the 32 cores reads the whole 32 MiB weight
    assert mm["naive"].dram_MB > 32 * 4096 * 4096 * 2 / 1e6
    assert mm["naive"].ring_MB == 0
    assert (
        mm["optimised"].dram_MB < 1.05 * (512 * 4096 * 2 + 4096 * 4096 * 2 + 512 * 4096 * 2) / 1e6
    )
    mlp = results["SwiGLU MLP 4096->12800->4096 M=512"].plans
    assert mlp["unfused"].kernels > mlp["optimised"].kernels == 1
    # the hidden activation never reaches device memory: weights + x + out
    assert mlp["optimised"].dram_MB < 1.05 * 3 * 4096 * 12800 * 2 / 1e6
    # 8-bit weights are read as 1 byte each, never as a stored 16-bit copy
    for n in (4096, 12800):
        g = results[f"decode GEMV W8A16 K=4096 N={n}"].plans["optimised"]
        assert g.kernels == 1 and g.dram_MB < 1.02 * (n * 4096 + 6 * n + 2 * 4096) / 1e6
    assert results["prefill W8A8 M=1024 K=4096 N=4096"].roof_pe_us == pytest.approx(
        results["prefill W8A16 M=1024 K=4096 N=4096"].roof_pe_us / 2
    )
    att = results["attention 32x128 heads, 1024 tokens, causal"].plans
    # scores stay in LX: about q, k, v and out once (33.5 MB), not the 134 MB
    # of fp32 scores the naive plan writes and reads
    assert att["optimised"].kernels == 1 and att["optimised"].dram_MB < 1.05 * 33.6
    assert att["naive"].dram_MB > 4 * 33.6


# ----------------------------------------------------------- numerics
SMALL = [
    ("linear", B._linear, [(64, 256), (384, 256)]),
    ("gemv", B._linear, [(1, 512), (640, 512)]),
    ("gemv k split", B._linear, [(1, 8192), (128, 8192)]),
    ("softmax", B._softmax, [(64, 256)]),
    ("rmsnorm", B._rmsnorm, [(64, 256), (256,)]),
    ("layernorm", B._layernorm, [(64, 256), (256,), (256,)]),
    ("swiglu", B._swiglu, [(64, 256), (640, 256), (640, 256), (256, 640)]),
    ("attention", B._attention, [(1, 4, 64, 32)] * 3),
]


MODES = [(c, m) for c in SMALL for m in ("optimised", "naive")] + [(SMALL[6], "unfused")]


@pytest.mark.parametrize("case,mode", MODES, ids=[f"{c[0]}-{m}" for c, m in MODES])
def test_plans_compute_the_right_values(case, mode):
    name, fn, shapes = case
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(s, generator=g) / math.sqrt(s[-1])).to(torch.float16) for s in shapes]
    if name in ("rmsnorm", "layernorm"):
        xs = [xs[0] * 8, *(1 + x for x in xs[1:])]
    want = fn(*[x.float() for x in xs])
    torch._dynamo.reset()
    opts = {"optimised": {}, "unfused": {"fusion": False}, "naive": {"naive": True}}[mode]
    scheduling.PLANS.clear()  # bounded: a trim during this compile would hide its plans
    with options.planning(**opts):
        got = torch.compile(lambda *a: fn(*a), fullgraph=True, dynamic=False)(
            *[x.to("spyre") for x in xs]
        )
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)
    if name == "gemv k split" and mode == "optimised":
        # the cost model splits k over cores (2 sticks of n): partial sums
        # combined by a ring all-reduce, and the values still match
        plans = list(scheduling.PLANS)
        assert any(isinstance(s, RingAllReduce) for p in plans for s in p.program.steps)


def test_timing_only_times_without_executing():
    from torch_spyre import kernels
    from torch_spyre.sim import SimulatedCard, timing_only_active

    card = SimulatedCard(0)
    p = kernels.elementwise("add", (64, 128))
    bufs = {o.name: torch.ones(o.layout.device_size, dtype=o.layout.dtype) for o in p.operands}
    bufs["out"].zero_()
    with timing_only():
        assert timing_only_active()
        rep = card.run(p, bufs)
    assert not timing_only_active()
    assert card.clock_s == pytest.approx(rep.time_s) and card.stats()["kernels"] == 1
    assert bufs["out"].eq(0).all()  # timed, not executed
    card.run(p, bufs)
    assert bufs["out"].eq(2).all()  # executed outside
    assert card.clock_s == pytest.approx(2 * rep.time_s)
