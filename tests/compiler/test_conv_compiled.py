"""Convolutional networks compiled on spyre: convolutions (routed to the
device's im2col program through ``spyre::convolution``:
compiler/conv_routes.py), batch norm (fused into
pointwise kernel programs) and pooling (routed to the device's pooling
programs: compiler/pool_routes.py) run with no host fallback and no degraded
node, matching the CPU in fp32."""

import copy

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import fresh_cache

from torch_spyre.compiler import degrade
from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import tolerances


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, the residual, ReLU."""

    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + x)


def _tiny_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
    )  # fmt: skip


def _resnet():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1), Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def _others():
    return nn.Sequential(
        nn.Conv1d(4, 6, 3, stride=2, groups=2), nn.ConvTranspose1d(6, 4, 3, stride=2),
        nn.AvgPool1d(3, 2, 1, ceil_mode=True),
    )  # fmt: skip


@pytest.mark.parametrize(
    "make,shape",
    [(_tiny_cnn, (2, 3, 8, 8)), (_resnet, (2, 3, 16, 16)), (_others, (2, 4, 19))],
    ids=["tiny_cnn", "resnet_block", "conv1d_transposed_avgpool"],
)
def test_compiled_cnn_runs_on_the_card(make, shape):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # running statistics that are not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(*shape)
    want = model(x)
    dev = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    dispatch_stats.reset()
    degrade.reset_counts()
    with fresh_cache():
        got = torch.compile(dev, fullgraph=True, dynamic=False)(x.to("spyre"))
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))
    assert dispatch_stats.counts("fallback") == {}
    assert dispatch_stats.counts("degraded") == {}
    assert not any(degrade.counts().values())
    kernels = dispatch_stats.counts("kernel")
    assert kernels.get("convolution_overrideable.default", 0) >= 1


def _hf_backbone(kind: str):
    transformers = pytest.importorskip("transformers")
    if kind == "resnet":
        cfg = transformers.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"
        )
        return transformers.ResNetModel(cfg)
    cfg = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
    return transformers.ConvNextModel(cfg)


@pytest.mark.parametrize("kind", ["resnet", "convnext"])
def test_tiny_hf_vision_backbones_run_on_the_card_eager_and_compiled(kind):
    """Hugging Face ResNet (its stem's max pool sees an odd 33x33 map: the eager
    values-only max pool must not leak into the traced graph) and ConvNeXt
    (depthwise 7x7 convs, layer norms)."""
    torch.manual_seed(0)
    model = _hf_backbone(kind).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model(x).pooler_output
        dev = copy.deepcopy(model).to("spyre")
        for compiled in (False, True):
            torch._dynamo.reset()
            dispatch_stats.reset()
            fn = torch.compile(dev, fullgraph=True, dynamic=False) if compiled else dev
            with fresh_cache():
                got = fn(x.to("spyre")).pooler_output
            torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))
            assert dispatch_stats.counts("fallback") == {}
            assert dispatch_stats.counts("degraded") == {}


def test_a_conv_block_keeps_its_layouts_and_its_bias_in_the_matmul():
    """A fp16 conv (bias) + BatchNorm2d (eval) + ReLU block: the convolution is
    the device program in the graph's own layouts (no channels-last copies of
    its input or weights, as Inductor's ``aten.convolution`` lowering made:
    208.52 us modelled then), its bias in the matmul program, and the batch
    norm with the ReLU one pointwise program."""
    from torch_spyre.profiler import profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(1, 64, 56, 56)
    want = model(x)
    dev = copy.deepcopy(model).half().to("spyre")
    torch._dynamo.reset()
    with fresh_cache(), torch.no_grad():
        fn = torch.compile(dev, fullgraph=True, dynamic=False)
        xs = x.half().to("spyre")
        fn(xs)
        with profile() as p:
            got = fn(xs)
    torch.testing.assert_close(got.cpu().float(), want, **tolerances(torch.float16))
    names = [k.name for k in p.kernels]
    assert sum(n.startswith("addmm_") for n in names) == 1, names  # the bias in the matmul
    assert sum(n.startswith("fused_") for n in names) == 1, names  # BN + ReLU, one pass
    assert not any("convolution" in n for n in names), names  # no re-layout programs
    assert p.total_time_s * 1e6 == pytest.approx(135.66, rel=1e-3)
