"""The causal depthwise conv1d of Mamba-2 layers as a kernel program."""

import pytest
import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.kernels.ssm import depthwise_conv1d
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


def test_other_convolutions_still_fall_back():
    x, w = torch.randn(1, 4, 9), torch.randn(6, 4, 3)
    torch_spyre.reset_fallback_counts()
    got = F.conv1d(x.to("spyre"), w.to("spyre"))
    torch.testing.assert_close(got.cpu(), F.conv1d(x, w), **tolerances(torch.float32))
    assert torch_spyre.fallback_counts() == {"convolution.default": 1}


def test_conv_reads_the_input_once_per_tap():
    card = get_card(0)
    r2 = card.estimate(depthwise_conv1d(1, 512, 1024, 2, torch.float16))
    r4 = card.estimate(depthwise_conv1d(1, 512, 1024, 4, torch.float16))
    x_bytes = 1 * 515 * 1024 * 2
    assert r4.dram_bytes - r2.dram_bytes >= 2 * 512 * 1024 * 2  # two more shifted reads
    assert r4.dram_bytes >= 4 * 512 * 1024 * 2 and r4.compulsory_bytes >= x_bytes
