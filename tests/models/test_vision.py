"""Tiny vision backbones (ViT, DINOv2, ConvNeXt, ResNet) and a recurrent
classifier on the card, eager and compiled, against the CPU in fp32, with no
host fallback: patch-embedding and stage convolutions, batch / layer norms,
max pooling, class-token cats and the LSTM / GRU as device programs
(issue 28)."""

from __future__ import annotations

import pytest
import torch

import torch_spyre
from torch_spyre.compiler import degrade

transformers = pytest.importorskip("transformers")


def _vit():
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128,
    )  # fmt: skip
    return transformers.ViTModel(cfg, add_pooling_layer=False), (1, 3, 32, 32)


def _dinov2():
    cfg = transformers.Dinov2Config(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, mlp_ratio=2,
    )  # fmt: skip
    return transformers.Dinov2Model(cfg), (1, 3, 32, 32)


def _convnext():
    cfg = transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32,
    )  # fmt: skip
    return transformers.ConvNextModel(cfg), (1, 3, 32, 32)


def _resnet():
    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
        layer_type="basic",
    )  # fmt: skip
    return transformers.ResNetModel(cfg), (1, 3, 32, 32)


class _Recurrent(torch.nn.Module):
    """A 2-layer LSTM or GRU classifier over a feature sequence."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
        self.rnn = rnn(6, 16, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


BUILDERS = {
    "vit": _vit, "dinov2": _dinov2, "convnext": _convnext, "resnet": _resnet,
    "lstm": lambda: (_Recurrent("lstm"), (2, 7, 6)), "gru": lambda: (_Recurrent("gru"), (2, 7, 6)),
}  # fmt: skip


def _output(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.last_hidden_state


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backbone_on_the_card_without_the_host(name, compiled):
    torch.manual_seed(0)
    model, shape = BUILDERS[name]()
    model = model.eval()
    x = torch.randn(shape)
    with torch.no_grad():
        want = _output(model(x))
        dev = model.to("spyre")
        run = torch.compile(dev, fullgraph=False) if compiled else dev
        torch_spyre.reset_fallback_counts()
        degrade.reset_counts()
        got = _output(run(x.to("spyre"))).cpu()
    assert torch_spyre.fallback_counts() == {}
    if compiled:
        assert degrade.counts()["host"] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
