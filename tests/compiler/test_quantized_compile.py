"""torch.compile of quantised matmuls: a weight's dequantisation planned into its
matmul (8-bit weight and scale as operands, nothing 16-bit stored), and
aten._scaled_mm with its scales and an epilogue fused, against the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.compiler import scheduling
from torch_spyre.kernels import options
from torch_spyre.profiler import profile
from torch_spyre.runtime import cards
from torch_spyre.testing import tolerances

EIGHT_BIT = (torch.float8_e4m3fn, torch.int8)


def _programs(fn, *args):
    """Compile and run ``fn`` (planned, not replayed from the FX cache): its
    output and the programs that ran."""
    torch._dynamo.reset()
    scheduling.PLANS.clear()
    torch_spyre.reset_fallback_counts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        with profile() as prof:
            out = torch.compile(fn, fullgraph=True)(*args)
    assert torch_spyre.fallback_counts() == {}
    ran = [k.name for k in prof.kernels]
    planned = {p.program.name: p.program for p in scheduling.PLANS}
    return out, [planned[n] for n in ran]


def _pe(progs):
    return [p for p in progs if any(type(s).__name__ == "Matmul" for s in p.steps)]


def _block(x, w, s, b):
    # the weight's dequantisation is scheduled apart from (before) the
    # activation's producer: its inputs must stay alive until the matmul runs
    return F.silu(torch.ops.spyre.quantized_linear(x * 0.5 + 1.0, w, s, b))


@pytest.mark.parametrize(
    "wdtype, scale_shape",
    [(torch.float8_e4m3fn, (192,)), (torch.int8, (1,))],
    ids=["fp8-channel", "int8-tensor"],
)
def test_dequantisation_is_planned_into_its_matmul(wdtype, scale_shape):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 256, dtype=torch.float16)  # decode-like: a weight stream
    w = torch.ops.spyre.quantize(torch.randn(192, 256), torch.tensor(0.02), wdtype)
    s = torch.rand(scale_shape) * 0.002 + 0.001  # outputs O(1-10): fp16 tolerances apply
    b = torch.randn(192, dtype=torch.float16)
    args = [t.to("spyre") for t in (x, w, s, b)]
    out, progs = _programs(_block, *args)
    torch.testing.assert_close(out.cpu(), _block(x, w, s, b), **tolerances(torch.float16))
    (mm,) = _pe(progs)
    ins = {o.layout.dtype for o in mm.operands if o.role == "input"}
    assert wdtype in ins  # the 8-bit weight is the program's operand ...
    assert not any(o.role == "output" and o.layout.host_size == (192, 256) for p in progs
                   for o in p.operands)  # fmt: skip  # ... and no 16-bit copy is stored
    assert len(progs) <= 2  # the activation's producer, the matmul with its epilogue

    # what the 8-bit weight saves: the same graph with the fp16 weight as input
    w16 = torch.ops.spyre.dequantize(w, s.reshape(-1, 1) if s.numel() > 1 else s, torch.float16)
    w16 = w16.to("spyre")
    _, progs16 = _programs(
        lambda x, w, b: F.silu(F.linear(x * 0.5 + 1.0, w, b)), args[0], w16, args[3]
    )
    card = cards.card(0)
    r8, r16 = card.estimate(mm), card.estimate(_pe(progs16)[0])
    assert r8.dram_bytes < 0.6 * r16.dram_bytes  # 1 byte per weight element, not 2


def test_without_fusion_the_dequantisation_is_its_own_kernel():
    torch.manual_seed(0)
    x = torch.randn(16, 128, dtype=torch.float16)
    w = torch.randn(64, 128).to(torch.float8_e4m3fn)
    s = torch.rand(64, 1) * 0.05
    args = [t.to("spyre") for t in (x, w, s)]

    def f(x, w, s):
        return torch.ops.spyre.quantized_linear(x, w, s)

    with options.planning(fusion=False):
        out, progs = _programs(f, *args)
    torch.testing.assert_close(out.cpu(), f(x, w, s), **tolerances(torch.float16))
    assert any(o.role == "output" and o.layout.host_size == (64, 128) for p in progs
               for o in p.operands)  # fmt: skip


def test_scaled_mm_compiles_to_one_program_with_its_epilogue():
    torch.manual_seed(0)
    a = (torch.randn(64, 256) * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(128, 256) * 3).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(64, 1) * 0.05, torch.rand(1, 128) * 0.05
    bias, res = torch.randn(128, dtype=torch.float16), torch.randn(64, 128, dtype=torch.float16)

    def f(a, w, sa, sb, bias, res):
        y = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.float16)
        return F.gelu(y) + res

    args = [t.to("spyre") for t in (a, w, sa, sb, bias, res)]
    out, progs = _programs(f, *args)
    torch.testing.assert_close(out.cpu(), f(a, w, sa, sb, bias, res), **tolerances(torch.float16))
    (prog,) = progs
    mm = next(s for s in prog.steps if type(s).__name__ == "Matmul")
    # both PE operands are 8-bit: the PE array runs at its 8-bit rate
    assert prog.buffer(mm.a).dtype == prog.buffer(mm.b).dtype == torch.float8_e4m3fn
    # one loop nest: the per-row scale is loaded outside the column loop
    loops = [s.loops for s in prog.steps]
    assert max(len(lp) for lp in loops) == len(prog.loop_order)
