"""Pooling 1-3d on the card (window gathers and reductions), against the CPU."""

import pytest
import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.profiler import profile
from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.testing import tolerances

SHAPES = {1: (2, 3, 11), 2: (2, 3, 9, 8), 3: (2, 3, 7, 6, 5)}

CASES = [
    # (function, dims, keyword arguments)
    ("max_pool{}d", 1, {"kernel_size": 2}),
    ("max_pool{}d", 2, {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("max_pool{}d", 2, {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 2,
                        "ceil_mode": True}),
    ("max_pool{}d", 3, {"kernel_size": 2, "stride": (1, 2, 2), "padding": 1, "ceil_mode": True}),
    ("avg_pool{}d", 1, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    ("avg_pool{}d", 2, {"kernel_size": 3, "stride": 2, "padding": 1}),
    ("avg_pool{}d", 2, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True,
                        "count_include_pad": False}),
    ("avg_pool{}d", 2, {"kernel_size": 2, "divisor_override": 3}),
    ("avg_pool{}d", 3, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True,
                        "count_include_pad": False}),
    ("adaptive_avg_pool{}d", 1, {"output_size": 4}),
    ("adaptive_avg_pool{}d", 2, {"output_size": (4, 3)}),  # uneven windows: a matmul per dim
    ("adaptive_avg_pool{}d", 2, {"output_size": (3, 4)}),  # even: an average pool
    ("adaptive_avg_pool{}d", 2, {"output_size": 1}),  # global: a mean
    ("adaptive_avg_pool{}d", 3, {"output_size": (2, 3, 4)}),
    ("adaptive_max_pool{}d", 1, {"output_size": 4}),
    ("adaptive_max_pool{}d", 2, {"output_size": (4, 3)}),
    ("adaptive_max_pool{}d", 3, {"output_size": (2, 4, 3)}),
    ("lp_pool{}d", 1, {"norm_type": 2, "kernel_size": 3}),
    ("lp_pool{}d", 2, {"norm_type": 3, "kernel_size": 2, "stride": 2}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].format(c[1])}-{c[2]}")
def test_pooling_runs_on_the_card(case):
    name, nd, kw = case
    fn = getattr(F, name.format(nd))
    if "max" in name:
        kw = {**kw, "return_indices": True}
    x = torch.randn(*SHAPES[nd], generator=torch.Generator().manual_seed(nd))
    want = fn(x, **kw)
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = fn(x.to("spyre"), **kw)
    assert torch_spyre.fallback_counts() == {}
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple)
                    else (want,)):  # fmt: skip
        # an odd-order LP pool of a negative window sum is NaN on both sides
        torch.testing.assert_close(g.cpu(), w, equal_nan=True, **tolerances(torch.float32))


def test_unbatched_and_tied_max_pool_indices_are_pytorchs():
    # ties: PyTorch returns the first maximum in raster order
    x = torch.zeros(3, 6, 6)
    x[:, 2:4, 2:4] = 1.0
    for fn, kw in [(F.max_pool2d, {"kernel_size": 3, "stride": 2, "padding": 1}),
                   (F.adaptive_max_pool2d, {"output_size": (4, 4)})]:  # fmt: skip
        want = fn(x, return_indices=True, **kw)
        with fallback_policy("error"):
            got = fn(x.to("spyre"), return_indices=True, **kw)
        torch.testing.assert_close(got[0].cpu(), want[0])
        torch.testing.assert_close(got[1].cpu(), want[1])


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_follows_the_samples(nd):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, *([9] * nd), generator=g)
    samples = torch.rand(2, 3, nd, generator=g)
    op = getattr(torch.ops.aten, f"fractional_max_pool{nd}d")
    want = op(x, [2] * nd, [4] * nd, samples)
    with fallback_policy("error"):
        got = op(x.to("spyre"), [2] * nd, [4] * nd, samples.to("spyre"))
    torch.testing.assert_close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1])


def test_local_response_norm_runs_on_the_card():
    x = torch.randn(2, 6, 5, 4)
    with fallback_policy("error"):
        got = F.local_response_norm(x.to("spyre"), size=3)
    torch.testing.assert_close(got.cpu(), F.local_response_norm(x, 3), **tolerances(torch.float32))


def test_max_pool_is_a_gather_and_one_reduction():
    x = torch.randn(2, 16, 32, 32).to("spyre")
    with profile() as prof:
        F.max_pool2d(x, 3, 2, 1)
    names = [k.name for k in prof.kernels]
    # the maxima of the gathered windows, taps leading: [9, N, C, Ho, Wo]
    assert "amax_9x2x16x16x16_dim0" in names
    assert prof.fallbacks == {}
    # the windows moved on the card once: 9 taps of each of the 2*16*16*16
    # outputs, the stick dim (Wo = 16 fp32 of 32 lanes) padded to whole sticks
    moved = sum(t.nbytes for t in prof.transfers if t.kind == "d2d")
    assert 9 * 2 * 16 * 16 * 16 * 4 <= moved <= 3 * 9 * 2 * 16 * 16 * 32 * 4


def test_max_pool_without_indices_computes_no_argmax():
    x = torch.randn(2, 8, 12, 12)
    xs = x.to("spyre")
    with profile() as prof:
        got = F.max_pool2d(xs, 3, 2, 1)
    names = [k.name for k in prof.kernels]
    assert any(n.startswith("amax_") for n in names)
    assert not any(n.startswith(("argmax_", "gather_")) for n in names), names
    torch.testing.assert_close(got.cpu(), F.max_pool2d(x, 3, 2, 1))
    # with gradients the composite keeps its indices for the backward
    xg = x.clone().to("spyre").requires_grad_()
    F.max_pool2d(xg, 3, 2, 1).sum().backward()
    xc = x.clone().requires_grad_()
    F.max_pool2d(xc, 3, 2, 1).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad)
