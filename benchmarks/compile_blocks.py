"""Compiled transformer blocks on spyre: modelled time eager vs compiled, and
compile time against CPU Inductor in the same run.

    python benchmarks/compile_blocks.py [--seq 32] [--hidden 256]

The Llama-style block: RMSNorm, rotary embedding, causal attention with
grouped KV heads, SwiGLU MLP, residuals.  The last row is a block with a node
the planner cannot take (an atan activation): the compiled graph runs it as
eager kernels (the degrade path, docs/compiler.md) and is still not slower
than eager in modelled time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import torch_spyre  # noqa: F401
from torch_spyre.compiler import degrade
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats


class LlamaBlock(torch.nn.Module):
    """RMSNorm, rotary embedding, causal attention with grouped KV heads,
    residual, RMSNorm, SwiGLU MLP, residual."""

    def __init__(
        self, d: int, heads: int, ffn: int, kv_heads: int | None = None, max_seq: int = 64
    ) -> None:
        super().__init__()
        self.h = heads
        self.kvh = kv_heads or max(1, heads // 2)
        hd = d // heads
        self.n1 = torch.nn.Parameter(torch.ones(d))
        self.n2 = torch.nn.Parameter(torch.ones(d))
        self.q = torch.nn.Linear(d, d, bias=False)
        self.kv = torch.nn.Linear(d, 2 * self.kvh * hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.g = torch.nn.Linear(d, ffn, bias=False)
        self.u = torch.nn.Linear(d, ffn, bias=False)
        self.dn = torch.nn.Linear(ffn, d, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_seq).float(), inv)
        ang = torch.cat((ang, ang), -1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    @staticmethod
    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    @staticmethod
    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, x):
        b, s, d = x.shape
        hd = d // self.h
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.rms(x, self.n1)
        q = self.q(h).reshape(b, s, self.h, hd).transpose(1, 2)
        k, v = self.kv(h).split(self.kvh * hd, -1)
        k, v = (t.reshape(b, s, self.kvh, hd).transpose(1, 2) for t in (k, v))
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.rms(x, self.n2)
        return x + self.dn(F.silu(self.g(h)) * self.u(h))


class BertLayer(torch.nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.h = heads
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.v = torch.nn.Linear(d, d)
        self.o = torch.nn.Linear(d, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.i = torch.nn.Linear(d, ffn)
        self.out = torch.nn.Linear(ffn, d)
        self.ln2 = torch.nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (
            m(x).reshape(b, s, self.h, d // self.h).transpose(1, 2)
            for m in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.out(F.gelu(self.i(x))))


class OddMLP(torch.nn.Module):
    """An MLP with an activation the vector unit has no step for (atan): the
    compiled graph degrades that node to eager kernels (compiler/degrade.py),
    and its modelled time must still not be worse than eager."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, ffn)
        self.down = torch.nn.Linear(ffn, d)
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.down(torch.atan(self.up(x)) * 0.5))


def _first_and_warm(fn, x) -> tuple[torch.Tensor, float]:
    """(output, compile seconds): the first call's time minus a warm call's
    (a spyre call runs the simulated card, which is not compile time)."""
    t = time.perf_counter()
    out = fn(x)
    first = time.perf_counter() - t
    t = time.perf_counter()
    fn(x)
    return out, max(first - (time.perf_counter() - t), 1e-9)


def warm_up() -> None:
    """One small compile on each backend first, so that neither block's
    figure includes the one-time start-up of Dynamo / Inductor / the spyre
    backend (imports, registration)."""
    f = torch.compile(lambda a: torch.relu(a) + 1, fullgraph=True, dynamic=False)
    a = torch.randn(8, 64, dtype=torch.float16)
    f(a)
    f(a.to("spyre"))
    torch._dynamo.reset()


def run(name: str, block: torch.nn.Module, x: torch.Tensor) -> dict:
    torch._dynamo.reset()
    ref = block.float()(x.float())
    blk = block.half()
    cpu_fn = torch.compile(blk, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, cpu_s = _first_and_warm(cpu_fn, x)
        dev = blk.to("spyre")
        xs = x.to("spyre")
        fn = torch.compile(dev, fullgraph=True, dynamic=False)
        dispatch_stats.reset("fallback")
        before = degrade.counts()
        out, spyre_s = _first_and_warm(fn, xs)
    fallbacks = dispatch_stats.counts("fallback")
    degraded = sum(degrade.counts()[k] - before[k] for k in ("eager", "eager_extern"))
    with profile() as pc:
        fn(xs)
    with profile() as pe:
        dev(xs)
    err = (out.cpu().float() - ref).abs().max().item()
    blk.to("cpu")
    return {
        "name": name,
        "eager_kernels": len(pe.kernels),
        "eager_us": sum(k.time_s for k in pe.kernels) * 1e6,
        "compiled_kernels": len(pc.kernels),
        "compiled_us": sum(k.time_s for k in pc.kernels) * 1e6,
        "compile_spyre_s": spyre_s,
        "compile_cpu_s": cpu_s,
        "max_err": err,
        "fallbacks": fallbacks,
        "degraded": degraded,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    d = args.hidden
    x = torch.randn(1, args.seq, d, dtype=torch.float16)
    warm_up()
    rows = [
        run("llama-style block", LlamaBlock(d, args.heads, 4 * d), x),
        run("BERT encoder layer", BertLayer(d, args.heads, 4 * d), x),
        run("MLP, atan (degraded)", OddMLP(d, 4 * d), x),
    ]
    hdr = f"{'block':<28} {'eager':>16} {'compiled':>16} {'speedup':>8} {'compile s spyre/cpu':>20} {'max err':>8}"
    print(hdr)
    for r in rows:
        print(
            f"{r['name']:<28} {r['eager_kernels']:>3} k {r['eager_us']:>8.1f} us"
            f" {r['compiled_kernels']:>3} k {r['compiled_us']:>8.1f} us"
            f" {r['eager_us'] / r['compiled_us']:>7.2f}x"
            f" {r['compile_spyre_s']:>8.1f}/{r['compile_cpu_s']:.1f} = {r['compile_spyre_s'] / r['compile_cpu_s']:.2f}x"
            f" {r['max_err']:>8.4f}  fallbacks {r['fallbacks'] or 'none'}"
            f"  degraded nodes {r['degraded']}"
        )


if __name__ == "__main__":
    main()
