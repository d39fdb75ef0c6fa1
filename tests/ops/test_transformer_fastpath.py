"""The eval fast paths of ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` on the card (``ops/transformer.py``): their
native ops run as the card's attention, matmul and norm programs, with no
host fallback, against the CPU in fp32 (which takes the same fast path)."""

from __future__ import annotations

import pytest
import torch

import torch_spyre


def _run(module, *args, **kwargs):
    module = module.eval()
    with torch.no_grad():
        want = module(*args, **kwargs)
        dev = module.to("spyre")
        moved = {k: v.to("spyre") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        torch_spyre.reset_fallback_counts()
        got = dev(*[a.to("spyre") for a in args], **moved)
    assert torch_spyre.fallback_counts() == {}
    return got, want


@pytest.mark.parametrize("masks", ["none", "key_padding", "both"])
def test_multihead_attention_fast_path(masks):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 7, 32)
    kw = {"need_weights": False}
    if masks in ("key_padding", "both"):
        kw["key_padding_mask"] = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    if masks == "both":
        kw["attn_mask"] = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    (got, _), (want, _) = _run(mha, x, x, x, **kw)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_fast_path(norm_first, activation):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    x = torch.randn(2, 6, 32)
    got, want = _run(layer, x)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
