"""Convolutions on the card: the causal depthwise conv1d of Mamba-2 layers as its
own kernel program, every other one as a window gather and a matmul program."""

import pytest
import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.kernels.ssm import depthwise_conv1d
from torch_spyre.profiler import profile
from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.sim import get_card
from torch_spyre.testing import tolerances


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 96, 12, 4, 3), (2, 200, 7, 4, 0), (1, 64, 1, 4, 3)])
def test_depthwise_conv1d_matches_cpu(dtype, shape):
    b, c, t, k, p = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(b, c, t, generator=g).to(dtype), torch.randn(c, 1, k, generator=g).to(dtype)
    bias = torch.randn(c, generator=g).to(dtype)
    want = F.conv1d(x.float(), w.float(), bias.float(), padding=p, groups=c)
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = F.conv1d(x.to("spyre"), w.to("spyre"), bias.to("spyre"), padding=p, groups=c)
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.cpu().float(), want, **tolerances(dtype))


def _conv(nd, transposed):
    return getattr(F, f"conv_transpose{nd}d" if transposed else f"conv{nd}d")


#: (dims, groups, stride, padding, dilation, transposed)
CONVS = [
    (1, 1, 1, 0, 1, False), (1, 2, 2, 1, 1, False), (1, 1, 1, 2, 2, False),
    (2, 1, 1, 1, 1, False), (2, 2, 2, 0, 1, False), (2, 4, 1, 2, 2, False),
    (3, 1, 2, 1, 1, False), (3, 2, 1, 1, 2, False),
    (1, 1, 2, 1, 1, True), (2, 1, 2, 1, 1, True), (2, 2, 3, 2, 2, True), (3, 1, 2, 0, 1, True),
]  # fmt: skip


@pytest.mark.parametrize("case", CONVS, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_convolutions_run_on_the_card(case, bias):
    nd, groups, stride, padding, dilation, transposed = case
    g = torch.Generator().manual_seed(nd * 100 + groups)
    x = torch.randn(2, 4, *[(9, 7, 6)[i] for i in range(nd)], generator=g)
    shape = (4, 8 // groups) if transposed else (8, 4 // groups)
    w = torch.randn(*shape, *([3] * nd), generator=g)
    b = torch.randn(8, generator=g) if bias else None
    kw = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    if transposed:
        kw["output_padding"] = 1 if stride > 1 else 0
    want = _conv(nd, transposed)(x, w, b, **kw)
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = _conv(nd, transposed)(
            x.to("spyre"), w.to("spyre"), None if b is None else b.to("spyre"), **kw
        )
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))


def test_conv_fp16_matches_cpu():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 8, 10, 10, generator=g), torch.randn(16, 8, 3, 3, generator=g)
    want = F.conv2d(x, w, padding=1)
    with fallback_policy("error"):
        got = F.conv2d(x.half().to("spyre"), w.half().to("spyre"), padding=1)
    torch.testing.assert_close(got.cpu().float(), want, **tolerances(torch.float16))


def test_conv_is_a_gather_and_one_matmul_program():
    x, w, b = torch.randn(2, 16, 12, 12), torch.randn(32, 16, 3, 3), torch.randn(32)
    xs, ws, bs = x.to("spyre"), w.to("spyre"), b.to("spyre")
    with profile() as prof:
        got = F.conv2d(xs, ws, bs, padding=1)
    mms = [k for k in prof.kernels if k.name.startswith(("addmm", "mm", "bmm"))]
    # the bias rides in the matmul: [Cout, C*K] @ [C*K, N*H*W]
    assert [k.name for k in mms] == ["addmm_32x288x144"]
    assert prof.fallbacks == {}
    # the patch matrix (9 taps of the padded input) moves on the card
    moved = sum(t.nbytes for t in prof.transfers if t.kind == "d2d")
    assert moved >= 16 * 9 * 2 * 144 * 4
    assert all(t.kind == "d2d" for t in prof.transfers)
    torch.testing.assert_close(got.cpu(), F.conv2d(x, w, b, padding=1), **tolerances(torch.float32))


def test_conv_reads_the_input_once_per_tap():
    card = get_card(0)
    r2 = card.estimate(depthwise_conv1d(1, 512, 1024, 2, torch.float16))
    r4 = card.estimate(depthwise_conv1d(1, 512, 1024, 4, torch.float16))
    x_bytes = 1 * 515 * 1024 * 2
    assert r4.dram_bytes - r2.dram_bytes >= 2 * 512 * 1024 * 2  # two more shifted reads
    assert r4.dram_bytes >= 4 * 512 * 1024 * 2 and r4.compulsory_bytes >= x_bytes


def test_fp16_transposed_conv_is_the_correctly_rounded_result():
    """The card sums in fp32 and rounds once; the CPU's fp16 transposed conv
    rounds its col2im adds (why opcheck compares fp16 transposed convs with
    the fp32 result rounded: ``FP16_REFERENCE_IN_FP32``)."""
    from torch_spyre.tools.opcheck.compare import FP16_REFERENCE_IN_FP32

    assert "nn.functional.conv_transpose2d" in FP16_REFERENCE_IN_FP32
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 2, 5, 5, generator=g) * 18 - 9).half()  # OpInfo's value range
    w = (torch.rand(2, 4, 3, 3, generator=g) * 18 - 9).half()
    rounded = F.conv_transpose2d(x.float(), w.float()).half().float()
    with fallback_policy("error"):
        got = F.conv_transpose2d(x.to("spyre"), w.to("spyre")).cpu().float()
    # within an ulp of the correctly rounded result
    torch.testing.assert_close(got, rounded, rtol=2**-10, atol=2**-14)
