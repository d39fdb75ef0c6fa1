"""Batch and instance norm (eval and batch statistics), the losses (elementwise,
NLL, BCE) and GLU on the card, against the CPU."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.testing import tolerances

NORMS = [
    (lambda: nn.BatchNorm1d(4), (5, 4)),
    (lambda: nn.BatchNorm1d(4), (5, 4, 3)),
    (lambda: nn.BatchNorm2d(4), (2, 4, 5, 3)),
    (lambda: nn.BatchNorm2d(4, momentum=None), (2, 4, 5, 3)),
    (lambda: nn.BatchNorm3d(4, affine=False), (2, 4, 3, 3, 2)),
    (lambda: nn.InstanceNorm1d(4), (2, 4, 7)),
    (lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True), (2, 4, 5, 3)),
    (lambda: nn.InstanceNorm3d(4), (2, 4, 3, 3, 2)),
]


#: stable ids (a lambda's repr differs between processes, and pytest-xdist's
#: workers must collect the same names)
NORM_IDS = ["bn1d", "bn1d-3d", "bn2d", "bn2d-cma", "bn3d-noaffine", "in1d", "in2d-stats", "in3d"]


@pytest.mark.parametrize("make,shape", NORMS, ids=NORM_IDS)
def test_norm_matches_cpu_and_updates_running_stats(make, shape):
    torch.manual_seed(0)
    ref = make()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for t in ref.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5)
    dev = copy.deepcopy(ref).to("spyre")
    for training in (True, False, True):
        ref.train(training)
        dev.train(training)
        x = torch.randn(*shape)
        want = ref(x)
        with fallback_policy("error"):
            got = dev(x.to("spyre"))
        torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(dev.state_dict()[name].cpu(), t, **tolerances(t.dtype))


@pytest.mark.parametrize(
    "fn,kw",
    [(F.mse_loss, {}), (F.mse_loss, {"reduction": "none"}), (F.smooth_l1_loss, {"beta": 0.5}),
     (F.smooth_l1_loss, {"reduction": "sum"}), (F.huber_loss, {"delta": 0.7})],
)  # fmt: skip
def test_losses_run_on_the_card(fn, kw):
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    with fallback_policy("error"):
        got = fn(x.to("spyre"), t.to("spyre"), **kw)
    torch.testing.assert_close(got.cpu(), fn(x, t, **kw), **tolerances(torch.float32))


def test_glu_runs_on_the_card():
    x = torch.randn(3, 8, 5)
    with fallback_policy("error"):
        got = F.glu(x.to("spyre"), dim=1)
    torch.testing.assert_close(got.cpu(), F.glu(x, dim=1), **tolerances(torch.float32))


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"weight": True},
           {"weight": True, "reduction": "none"}, {"ignore_index": 1}],
    ids=str,
)  # fmt: skip
def test_nll_loss_runs_on_the_card(kw):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 4, generator=g).log_softmax(1)
    t = torch.tensor([0, 3, -100, 1, 2, 1])
    if "ignore_index" in kw:
        t[2] = 0
    if kw.get("weight"):
        kw = {**kw, "weight": torch.rand(4, generator=g)}
    dev = {k: v.to("spyre") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with fallback_policy("error"):
        got = F.nll_loss(x.to("spyre"), t.to("spyre"), **dev)
    torch.testing.assert_close(got.cpu(), F.nll_loss(x, t, **kw), **tolerances(torch.float32))


def test_cross_entropy_over_pixels_and_bce_run_on_the_card():
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, 4, 3, 3, generator=g), torch.randint(0, 4, (2, 3, 3), generator=g)
    with fallback_policy("error"):
        got = F.cross_entropy(x.to("spyre"), t.to("spyre"), label_smoothing=0.1)
    want = F.cross_entropy(x, t, label_smoothing=0.1)
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))
    p, y, w = torch.rand(4, 3, generator=g), torch.rand(4, 3, generator=g), torch.rand(3)
    with fallback_policy("error"):
        got = F.binary_cross_entropy(p.to("spyre"), y.to("spyre"), w.to("spyre"))
    want = F.binary_cross_entropy(p, y, w)
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))


def test_out_of_range_targets_and_probabilities_raise_as_on_the_cpu():
    x = torch.randn(3, 4).log_softmax(1).to("spyre")
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        F.nll_loss(x, torch.tensor([0, 7, 1]).to("spyre"))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(torch.full((3,), 1.5).to("spyre"), torch.ones(3).to("spyre"))
