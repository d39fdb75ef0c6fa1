"""Quantised ops on the card: quantise / dequantise (ours and IBM's names), the
weight-only quantised linear and aten._scaled_mm, against the CPU; their
modelled time (8-bit weights read half the bytes, W8A8 at the 8-bit PE rate)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_spyre
from torch_spyre.kernels import eager as programs
from torch_spyre.runtime import cards
from torch_spyre.testing import tolerances

QDTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize(
    "scale_shape, scale_dtype",
    [
        ((), torch.float16),
        ((1,), torch.float32),
        ((2, 37, 1), torch.float16),
        ((130,), torch.float32),
    ],
    ids=["tensor-0d", "tensor-fp32", "per-token", "per-channel"],
)
def test_quantize_and_dequantize_are_bit_exact(qdtype, scale_shape, scale_dtype, stats):
    torch.manual_seed(0)
    x = torch.randn(2, 37, 130, dtype=torch.float16) * 4
    x[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # saturation and signed zeros
    s = (torch.rand(scale_shape) * 0.05 + 0.004).to(scale_dtype)
    q_cpu = torch.ops.spyre.quantize(x, s, qdtype)
    q = torch.ops.spyre.quantize(x.to("spyre"), s.to("spyre"), qdtype)
    assert q.device.type == "spyre" and q.dtype == qdtype
    assert _same_bits(q, q_cpu)
    d = torch.ops.spyre.dequantize(q, s.to("spyre"), torch.float16)
    assert d.dtype == torch.float16
    assert _same_bits(d, torch.ops.spyre.dequantize(q_cpu, s, torch.float16))
    assert stats.counts().get(("kernel", "spyre.quantize")) == 1
    assert stats.counts().get(("kernel", "spyre.dequantize")) == 1
    assert torch_spyre.fallback_counts() == {}


def test_ibm_fp8_reference_semantics():
    """spyre-inference's tests/test_fp8.py reference: clamp at +-448 after the scale."""
    from torch_spyre._inductor.constants import FP8_E4M3FN_MAX

    for values, scale, want in (
        ([500.0, -500.0, 1000.0], 1.0, [FP8_E4M3FN_MAX, -FP8_E4M3FN_MAX, FP8_E4M3FN_MAX]),
        ([1.0, -1.0, 50.0], 0.1, [10.0, -10.0, FP8_E4M3FN_MAX]),
    ):
        x = torch.tensor(values, dtype=torch.float16)
        s = torch.tensor([scale], dtype=torch.float16)
        q = torch.ops.spyre.quantize_fp8_with_scale(x.to("spyre"), s.to("spyre"))
        assert q.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(
            q.cpu().to(torch.float16), torch.tensor(want, dtype=torch.float16), atol=0, rtol=0
        )


def test_ibm_fp8_roundtrip_eager_and_compiled_without_fallback():
    """IBM's smoke test (shape [1, 128, 512], scale 1, compiled), exact against
    its CPU reference; per-token scales too."""
    torch.manual_seed(42)
    x = torch.randn((1, 128, 512), dtype=torch.float16) * 2.0 + 1.0

    def ref(x, s):
        return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float16) * s

    def roundtrip(x, s):
        q = torch.ops.spyre.quantize_fp8_with_scale(x, s)
        return torch.ops.spyre.dequantize_fp8_with_scale(q, s)

    from torch_spyre.ops.fallbacks import FallbackWarning

    compiled = torch.compile(roundtrip, fullgraph=True)
    for s in (torch.tensor([1.0], dtype=torch.float16), torch.rand(1, 128, 1).half() * 0.05):
        xs, ss = x.to("spyre"), s.to("spyre")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            eager = roundtrip(xs, ss)
            comp = compiled(xs, ss)
        assert eager.dtype == comp.dtype == torch.float16
        torch.testing.assert_close(eager.cpu(), ref(x, s), atol=0, rtol=0)
        torch.testing.assert_close(comp.cpu(), ref(x, s), atol=0, rtol=0)
    assert torch_spyre.fallback_counts() == {}


@pytest.mark.parametrize("wdtype", QDTYPES, ids=str)
@pytest.mark.parametrize(
    "scale_shape, scale_dtype",
    [((1,), torch.float32), ((96,), torch.float32), ((96, 1), torch.float16), ((), torch.bfloat16)],
    ids=["tensor", "channel", "channel-fp16", "tensor-bf16"],
)
def test_quantized_linear_matches_the_cpu(wdtype, scale_shape, scale_dtype, stats):
    torch.manual_seed(1)
    x = torch.randn(3, 21, 200, dtype=torch.float16)
    w = torch.ops.spyre.quantize(torch.randn(96, 200), torch.tensor(0.02), wdtype)
    s = (torch.rand(scale_shape) * 0.05 + 0.01).to(scale_dtype)
    b = torch.randn(96, dtype=torch.float16)
    want = torch.ops.spyre.quantized_linear(x, w, s, b)  # the CPU: dequantise, then linear
    got = torch.ops.spyre.quantized_linear(
        x.to("spyre"), w.to("spyre"), s.to("spyre"), b.to("spyre")
    )
    assert got.shape == (3, 21, 96) and got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float16))
    assert stats.counts().get(("kernel", "spyre.quantized_linear")) == 1
    assert torch_spyre.fallback_counts() == {}


def test_quantized_linear_refuses_group_scales_with_a_way_out():
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device="spyre")
    x = torch.zeros(2, 256, dtype=torch.float16, device="spyre")
    with pytest.raises(NotImplementedError, match="per output channel.*dequantize"):
        torch.ops.spyre.quantized_linear(x, w, torch.ones(64, 2, device="spyre"))


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_scaled_mm_matches_the_cpu(rowwise, out_dtype, stats):
    torch.manual_seed(2)
    a = (torch.randn(40, 320) * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(96, 320) * 3).to(torch.float8_e4m3fn)
    if rowwise:
        sa, sb = torch.rand(40, 1) + 0.1, torch.rand(1, 96) * 0.1
    else:
        sa, sb = torch.tensor(0.3), torch.tensor(0.02)
    bias = torch.randn(96).to(out_dtype) if out_dtype != torch.float32 else None
    want = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    got = torch._scaled_mm(
        a.to("spyre"),
        w.to("spyre").t(),  # the weight read as it lies, indexed (n, k)
        scale_a=sa.to("spyre"),
        scale_b=sb.to("spyre"),
        bias=None if bias is None else bias.to("spyre"),
        out_dtype=out_dtype,
    )
    assert got.dtype == out_dtype
    torch.testing.assert_close(got.cpu(), want, **tolerances(out_dtype))
    assert stats.counts().get(("kernel", "_scaled_mm.default")) == 1
    assert torch_spyre.fallback_counts() == {}


def _gemv(m: int, **quant):
    k, n = 4096, 4096
    return programs.matmul(
        (m, k), ("m0", "k"), (n, k), ("n", "k"), (m, n), ("m0", "n"),
        {"m0": m, "n": n, "k": k}, torch.float16, **quant,
    )  # fmt: skip


def test_modelled_time_reads_half_the_weight_bytes_and_uses_the_8bit_pe_rate():
    card = cards.card(0)
    fp16 = card.estimate(_gemv(1))
    w8a16 = card.estimate(
        _gemv(1, b_dtype=torch.float8_e4m3fn, dequant=("mul", (4096,), ("n",), torch.float32))
    )
    # decode: a weight stream; the 8-bit weight is half the bytes and half the time
    assert w8a16.dram_bytes == pytest.approx(fp16.dram_bytes / 2, rel=0.01)
    assert w8a16.time_s == pytest.approx(fp16.time_s / 2, rel=0.05)
    assert w8a16.busy_s["vector"][0] > 0  # dequantised in LX by the vector units
    # prefill: both operands 8-bit (aten._scaled_mm) run the PE array at twice its rate
    scales = (("sa", (1,), (None,), torch.float32), ("sb", (1,), (None,), torch.float32))
    f16 = card.estimate(_gemv(512))
    w8a8 = card.estimate(
        _gemv(512, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, scales=scales)
    )
    w8a16p = card.estimate(
        _gemv(512, b_dtype=torch.int8, dequant=("mul", (1,), (None,), torch.float32))
    )
    assert w8a8.busy_s["pe"][0] == pytest.approx(f16.busy_s["pe"][0] / 2, rel=0.02)
    assert w8a16p.busy_s["pe"][0] == pytest.approx(f16.busy_s["pe"][0], rel=0.02)
    cfg = cards.config(0)
    assert w8a8.roofline_time_s >= w8a8.flops / cfg.peak_flops(torch.float8_e4m3fn)
    assert cfg.peak_flops(torch.float8_e4m3fn) == pytest.approx(2 * cfg.peak_flops())
