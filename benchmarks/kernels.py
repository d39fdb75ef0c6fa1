"""Kernel performance on the modelled card, through the real compiler path.

    python benchmarks/kernels.py [--json kernels.json] [--execute] [--only NAME]

Each case is a small PyTorch function on fp16 ``spyre`` tensors, compiled with
``torch.compile(fullgraph=True)``: once with the compiler's plans
("optimised": cost-model core split, ring multicast of shared tiles, fusion,
LX-resident intermediates) and once with ``kernels.options.planning(naive=True)``
(rows split over the cores, no operand reuse, no fusion, every intermediate
through device memory); the SwiGLU MLP also with ``planning(fusion=False)``
(optimised plans, nothing fused).  The kernels that ran are read from the
profiler, so the figures are those of the programs the compiler emitted.

By default programs are timed, not executed (``torch_spyre.sim.timing_only``):
the modelled figures are the same either way, and the functional executor
would spend minutes on the full-size fp16 cases of a small host.  ``--execute``
runs them too.

Roofline of a case (plan independent except the vector term):
* PE: matmul FLOP / PE peak of the cores the case may use;
* memory: compulsory bytes (inputs + outputs, once) / bandwidth, at the
  sustained LPDDR5 bandwidth the simulator is calibrated to (0.582 x 204.8 =
  119.2 GB/s, ``HardwareConfig.dram_efficiency``) and at the 204.8 GB/s peak;
* vector: the optimised kernels' vector operations / vector-unit peak.
The bound is the largest term (at the sustained bandwidth); attainment =
roofline / modelled.  docs/performance.md explains the choice of roof.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

import torch_spyre  # noqa: F401  (the spyre device)
import torch_spyre.profiler as sprof
from torch_spyre.kernels import options
from torch_spyre.runtime import cards
from torch_spyre.sim import timing_only

FP16 = torch.float16

#: targets from issue 6
TARGET_PE = 0.85  # compute-bound matmuls: fraction of PE peak
TARGET_BW = 0.90  # memory-bound kernels: fraction of the (sustained) LPDDR5 roof
TARGET_MATMUL_GAIN = 0.29  # optimised vs naive matmul: less time
TARGET_SOFTMAX_GAIN = 0.27
TARGET_MLP_UTIL = 0.80
TARGET_MLP_GAIN = 0.17  # fused vs unfused SwiGLU


@dataclass
class Case:
    name: str
    kind: str  # matmul | gemv | softmax | norm | mlp | attention | conv | pool
    #: shapes of the fp16 inputs, and the function of them
    shapes: list[tuple[int, ...]]
    fn: Callable
    flops: float
    #: compulsory bytes: every input and output once
    io_bytes: int
    cores: int | None = None  # None: the whole card
    modes: tuple[str, ...] = ("optimised", "naive")
    #: dtype of each input (default all fp16); 8-bit weights come with fp32 scales
    dtypes: tuple[torch.dtype, ...] | None = None
    #: the PE rate of the case's matmuls: (a, b) operand dtypes (8-bit x 8-bit: 2x)
    pe_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float16, torch.float16)


def _linear(x, w):
    return F.linear(x, w)


def _softmax(x):
    return torch.softmax(x, dim=-1)


def _rmsnorm(x, w):
    # Hugging Face Llama/Granite RMSNorm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def _layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _swiglu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _w8a16(x, w, s):
    # weight-only 8-bit: the weight streamed as 8-bit data, dequantised in LX
    return torch.ops.spyre.quantized_linear(x, w, s)


def _w8a8(a, w, sa, sw):
    # both operands fp8: the PE array at its 8-bit rate, scales in the epilogue
    return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=FP16)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _conv3x3(x, w):
    return F.conv2d(x, w, padding=1)


def _maxpool(x):
    return F.max_pool2d(x, 3, 2, 1)


def _nbytes(*shapes: tuple[int, ...]) -> int:
    # every size here is whole sticks, so device bytes = host bytes
    return sum(math.prod(s) * 2 for s in shapes)


def cases() -> list[Case]:
    out: list[Case] = []
    # Granite-3.3-8B prefill projections (nn.Linear weights [N, K])
    for m in (512, 1024):
        for k, n in ((4096, 4096), (4096, 1024), (4096, 12800), (12800, 4096)):
            out.append(
                Case(
                    f"prefill M={m} K={k} N={n}",
                    "matmul",
                    [(m, k), (n, k)],
                    _linear,
                    2.0 * m * n * k,
                    _nbytes((m, k), (n, k), (m, n)),
                )
            )
    for n in (4096, 12800, 49152):
        out.append(
            Case(
                f"decode GEMV K=4096 N={n}",
                "gemv",
                [(1, 4096), (n, 4096)],
                _linear,
                2.0 * n * 4096,
                _nbytes((1, 4096), (n, 4096), (1, n)),
            )
        )
    for m, n, c in ((512, 1024, 1), (512, 1024, None), (4096, 2048, None)):
        out.append(
            Case(
                f"softmax {m}x{n} {c or 32} core{'s' if c != 1 else ''}",
                "softmax",
                [(m, n)],
                _softmax,
                0.0,
                _nbytes((m, n), (m, n)),
                cores=c,
            )
        )
    out.append(
        Case(
            "RMSNorm 1024x4096",
            "norm",
            [(1024, 4096), (4096,)],
            _rmsnorm,
            0.0,
            _nbytes((1024, 4096), (4096,), (1024, 4096)),
        )
    )
    out.append(
        Case(
            "LayerNorm 1024x4096",
            "norm",
            [(1024, 4096), (4096,), (4096,)],
            _layernorm,
            0.0,
            _nbytes((1024, 4096), (4096,), (4096,), (1024, 4096)),
        )
    )
    h, f, m = 4096, 12800, 512
    out.append(
        Case(
            "SwiGLU MLP 4096->12800->4096 M=512",
            "mlp",
            [(m, h), (f, h), (f, h), (h, f)],
            _swiglu,
            3 * 2.0 * m * h * f,
            _nbytes((m, h), (f, h), (f, h), (h, f), (m, h)),
            modes=("optimised", "unfused", "naive"),
        )
    )
    out += _eight_bit_cases()
    # a ResNet-50 stage-1 3x3 convolution and the stem's max pool (issue 28):
    # im2col on the card (the window gather, a DMA program) and one matmul
    # program; the pool a window gather and one reduction
    n, c, hw = 8, 64, 56
    out.append(
        Case(
            f"conv2d 3x3 {c}->{c} {hw}x{hw} N={n}",
            "conv",
            [(n, c, hw, hw), (c, c, 3, 3)],
            _conv3x3,
            2.0 * n * c * hw * hw * c * 9,
            _nbytes((n, c, hw, hw), (c, c, 3, 3), (n, c, hw, hw)),
        )
    )
    out.append(
        Case(
            f"max_pool2d 3x3/2 {c}x{2 * hw}x{2 * hw} N={n}",
            "pool",
            [(n, c, 2 * hw, 2 * hw)],
            _maxpool,
            0.0,
            _nbytes((n, c, 2 * hw, 2 * hw), (n, c, hw, hw)),
        )
    )
    s, nh, d = 1024, 32, 128
    out.append(
        Case(
            "attention 32x128 heads, 1024 tokens, causal",
            "attention",
            [(1, nh, s, d)] * 3,
            _attention,
            # QK^T and PV over the full square (the PE array computes masked blocks too)
            2 * 2.0 * nh * s * s * d,
            _nbytes(*[(1, nh, s, d)] * 4),
        )
    )
    return out


def _eight_bit_cases() -> list[Case]:
    """The GEMV and prefill projections with fp8 weights (issue 17): W8A16 (one
    fp32 scale per output channel, activations fp16) and W8A8 ``_scaled_mm``
    (per-tensor scales).  Compulsory bytes count the weight at 1 byte."""
    f8, f32 = torch.float8_e4m3fn, torch.float32
    out = []
    for n in (4096, 12800):
        out.append(
            Case(
                f"decode GEMV W8A16 K=4096 N={n}",
                "gemv",
                [(1, 4096), (n, 4096), (n,)],
                _w8a16,
                2.0 * n * 4096,
                2 * 4096 + n * 4096 + 4 * n + 2 * n,
                dtypes=(FP16, f8, f32),
            )
        )
    for m, k, n in ((1024, 4096, 4096), (1024, 4096, 12800)):
        out.append(
            Case(
                f"prefill W8A16 M={m} K={k} N={n}",
                "matmul",
                [(m, k), (n, k), (n,)],
                _w8a16,
                2.0 * m * n * k,
                2 * m * k + n * k + 4 * n + 2 * m * n,
                dtypes=(FP16, f8, f32),
            )
        )
        out.append(
            Case(
                f"prefill W8A8 M={m} K={k} N={n}",
                "matmul",
                [(m, k), (n, k), (), ()],
                _w8a8,
                2.0 * m * n * k,
                m * k + n * k + 2 * m * n + 8,
                dtypes=(f8, f8, f32, f32),
                pe_dtypes=(f8, f8),
            )
        )
    return out


@dataclass
class Figures:
    """One plan of one case, from the kernels that ran."""

    time_us: float
    kernels: int
    utilisation: float  # time-weighted mean of the kernels' core utilisation
    bottleneck: str  # of the kernel that takes longest
    cores: int  # most cores any kernel used
    dram_MB: float
    ring_MB: float
    vector_ops: float
    copies_us: float = 0.0  # device-to-device copies (in time_us)
    per_kernel: list[dict] = field(default_factory=list)


@dataclass
class Result:
    name: str
    kind: str
    cores: int
    flops: float
    io_MB: float
    roof_pe_us: float
    roof_mem_us: float  # at the sustained bandwidth (the decision)
    roof_mem_peak_us: float  # at the 204.8 GB/s peak
    roof_vec_us: float
    bound: str
    roof_us: float
    attainment: float  # roof / modelled (sustained bandwidth)
    attainment_peak_bw: float  # roof with peak bandwidth / modelled
    pe_of_peak: float  # PE-peak time / modelled
    bw_of_sustained: float  # compulsory bytes at sustained bw / modelled
    bw_of_peak: float  # compulsory bytes at peak bw / modelled
    plans: dict[str, Figures]
    targets: list[dict]


def _inputs(case: Case, execute: bool) -> list[torch.Tensor]:
    dtypes = case.dtypes or (FP16,) * len(case.shapes)
    g = torch.Generator().manual_seed(0)
    out = []
    for s, dt in zip(case.shapes, dtypes, strict=True):
        if dt == torch.float32:  # scales: values matter to nothing but the numbers
            out.append(torch.rand(s, generator=g).add(0.5).div(64).to("spyre"))
        elif not execute:  # values unused: timed, not executed
            out.append(torch.empty(s, dtype=dt, device="spyre"))
        else:
            out.append((torch.randn(s, generator=g) / math.sqrt(s[-1])).to(dt).to("spyre"))
    return out


def measure(case: Case, mode: str, execute: bool = False) -> Figures:
    """Compile ``case`` under the planning options of ``mode`` and profile one run."""
    opts = {
        "optimised": {},
        "naive": {"naive": True},
        "unfused": {"fusion": False},
    }[mode]
    args = _inputs(case, execute)
    torch._dynamo.reset()

    def fn(*a):  # a fresh function object: Dynamo compiles it anew
        return case.fn(*a)

    ctx = timing_only() if not execute else _nullcontext()
    with options.planning(cores=case.cores, **opts), ctx:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        compiled(*args)  # compile (and a first run)
        with sprof.profile() as prof:
            compiled(*args)
    ks = prof.kernels
    if not ks:
        raise RuntimeError(f"{case.name} ({mode}): no kernel ran on the card")
    # copies on the card (a convolution's window gather) take time too
    moves = sum(t.time_s for t in prof.transfers if t.kind == "d2d")
    total = sum(k.time_s for k in ks) + moves
    longest = max(ks, key=lambda k: k.time_s)
    return Figures(
        time_us=total * 1e6,
        kernels=len(ks),
        utilisation=sum(k.utilisation * k.time_s for k in ks) / total,
        copies_us=moves * 1e6,
        bottleneck=longest.bottleneck,
        cores=max(k.cores_used for k in ks),
        dram_MB=sum(k.report.dram_bytes for k in ks) / 1e6,
        ring_MB=sum(k.report.ring_bytes for k in ks) / 1e6,
        vector_ops=sum(k.report.vector_ops for k in ks),
        per_kernel=[
            {
                "name": k.name,
                "time_us": k.time_s * 1e6,
                "cores": k.cores_used,
                "utilisation": k.utilisation,
                "bottleneck": k.bottleneck,
                "dram_MB": k.report.dram_bytes / 1e6,
            }
            for k in ks
        ],
    )


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def evaluate(case: Case, plans: dict[str, Figures]) -> Result:
    cfg = cards.config(0)
    cores = case.cores or cfg.cores
    pe = case.flops / cfg.peak_flops(case.pe_dtypes[0], cores, case.pe_dtypes[1])
    mem = case.io_bytes / cfg.sustained_bandwidth_Bps
    mem_peak = case.io_bytes / cfg.memory_bandwidth_Bps
    vec = plans["optimised"].vector_ops / (cfg.peak_vector_ops() * cores / cfg.cores)
    terms = {"compute": pe, "memory": mem, "vector": vec}
    bound = max(terms, key=lambda k: terms[k])
    roof = terms[bound]
    roof_peak = max(pe, mem_peak, vec)
    t = plans["optimised"].time_us * 1e-6
    res = Result(
        name=case.name,
        kind=case.kind,
        cores=cores,
        flops=case.flops,
        io_MB=case.io_bytes / 1e6,
        roof_pe_us=pe * 1e6,
        roof_mem_us=mem * 1e6,
        roof_mem_peak_us=mem_peak * 1e6,
        roof_vec_us=vec * 1e6,
        bound=bound,
        roof_us=roof * 1e6,
        attainment=roof / t,
        attainment_peak_bw=roof_peak / t,
        pe_of_peak=pe / t,
        bw_of_sustained=mem / t,
        bw_of_peak=mem_peak / t,
        plans=plans,
        targets=[],
    )
    res.targets = _targets(case, res)
    return res


def _target(what: str, value: float, goal: float, unit: str = "") -> dict:
    return {"target": what, "value": value, "goal": goal, "met": value >= goal}


def _targets(case: Case, r: Result) -> list[dict]:
    out = []
    p = r.plans
    gain = 1 - p["optimised"].time_us / p["naive"].time_us
    if r.bound == "compute":
        out.append(_target("PE peak (compute-bound)", r.pe_of_peak, TARGET_PE))
    elif r.bound == "memory":
        out.append(_target("sustained LPDDR5 bw (memory-bound)", r.bw_of_sustained, TARGET_BW))
    if case.kind in ("matmul", "gemv"):
        out.append(_target("less time than naive", gain, TARGET_MATMUL_GAIN))
    if case.kind == "softmax":
        out.append(_target("less time than naive", gain, TARGET_SOFTMAX_GAIN))
    if case.kind == "mlp":
        out.append(_target("fused core utilisation", p["optimised"].utilisation, TARGET_MLP_UTIL))
        fused_gain = 1 - p["optimised"].time_us / p["unfused"].time_us
        out.append(_target("fused: less time than unfused", fused_gain, TARGET_MLP_GAIN))
    return out


def run(
    only: str | None = None, execute: bool = False, log: Callable[[str], None] | None = None
) -> list[Result]:
    results = []
    for case in cases():
        if only and only.lower() not in case.name.lower():
            continue
        t0 = time.perf_counter()
        plans = {mode: measure(case, mode, execute) for mode in case.modes}
        results.append(evaluate(case, plans))
        if log:
            log(f"  {case.name}: {time.perf_counter() - t0:.1f} s")
    return results


def table(results: list[Result]) -> str:
    head = (
        f"| {'case':<44} | {'bound':<7} | {'opt us':>8} | {'roof us':>8} | {'attain':>6} "
        f"| {'%PE':>4} | {'%bw sus':>7} | {'%bw pk':>6} | {'util':>4} | {'bottleneck':<10} "
        f"| {'k':>2} | {'naive us':>9} | {'n.util':>6} | {'n.bottleneck':<12} | {'gain':>5} |"
    )
    sep = "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"
    lines = [head, sep]
    for r in results:
        o, n = r.plans["optimised"], r.plans["naive"]
        lines.append(
            f"| {r.name:<44} | {r.bound:<7} | {o.time_us:>8.1f} | {r.roof_us:>8.1f} "
            f"| {r.attainment:>6.1%} | {r.pe_of_peak:>4.0%} | {r.bw_of_sustained:>7.1%} "
            f"| {r.bw_of_peak:>6.1%} | {o.utilisation:>4.0%} | {o.bottleneck:<10} "
            f"| {o.kernels:>2} | {n.time_us:>9.1f} | {n.utilisation:>6.0%} | {n.bottleneck:<12} "
            f"| {1 - o.time_us / n.time_us:>5.0%} |"
        )
        if "unfused" in r.plans:
            u = r.plans["unfused"]
            lines.append(
                f"| {'  (unfused: ' + str(u.kernels) + ' kernels)':<44} | {'':<7} "
                f"| {u.time_us:>8.1f} | {'':>8} | {'':>6} | {'':>4} | {'':>7} | {'':>6} "
                f"| {u.utilisation:>4.0%} | {u.bottleneck:<10} | {u.kernels:>2} | {'':>9} "
                f"| {'':>6} | {'':<12} | {1 - o.time_us / u.time_us:>5.0%} |"
            )
    return "\n".join(lines)


def targets_table(results: list[Result]) -> str:
    lines = ["| case | target | value | goal | met |", "|---|---|---|---|---|"]
    for r in results:
        for t in r.targets:
            lines.append(
                f"| {r.name} | {t['target']} | {t['value']:.1%} | {t['goal']:.0%} "
                f"| {'yes' if t['met'] else 'NO (' + r.plans['optimised'].bottleneck + '-bound)'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="kernels.json", help="where to write the figures")
    ap.add_argument("--execute", action="store_true", help="also compute the values (slow)")
    ap.add_argument("--only", help="cases whose name contains this")
    args = ap.parse_args()
    torch._inductor.config.fx_graph_cache = False  # plan every case afresh
    cfg = cards.config(0)
    print(
        f"card: {cfg.cores} cores, PE peak {cfg.peak_flops() / 1e12:.3f} TFLOP/s fp16, LPDDR5 "
        f"{cfg.memory_bandwidth_Bps / 1e9:.1f} GB/s peak, {cfg.sustained_bandwidth_Bps / 1e9:.1f} "
        f"GB/s sustained (dram_efficiency {cfg.dram_efficiency}), "
        f"{'executed' if args.execute else 'timed, not executed'}",
        file=sys.stderr,
    )
    results = run(args.only, args.execute, log=lambda s: print(s, file=sys.stderr))
    print(table(results))
    print()
    print(targets_table(results))
    with open(args.json, "w") as f:
        json.dump(
            {
                "config": cfg.to_dict(),
                "roof": "sustained LPDDR5 bandwidth (dram_efficiency x peak); peak reported too",
                "results": [asdict(r) for r in results],
            },
            f,
            indent=1,
        )
    print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
