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


def _encoder(norm_first: bool = False):
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first)


@pytest.mark.parametrize("lengths", [(7, 5, 1), (7, 7, 7), (0, 3, 7)], ids=str)
def test_encoder_with_a_padding_mask_runs_nested_on_the_card(lengths):
    """``nn.TransformerEncoder`` in eval with a key padding mask packs the batch
    into a nested tensor (``ops/nested.py``): the card's nested tensor views
    the padded batch, each layer attends to the unpadded keys, and the padded
    positions come out as zeros, as on the CPU (which takes the same path)."""
    torch.manual_seed(0)
    x = torch.randn(len(lengths), 7, 32)
    mask = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]
    enc = _encoder()
    got, want = _run(enc, x, src_key_padding_mask=mask)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert bool((want[mask] == 0).all()) and bool((got.cpu()[mask] == 0).all())


def test_a_mask_that_is_not_left_aligned_takes_the_slow_path():
    """The encoder checks left alignment on the card
    (``_nested_tensor_from_mask_left_aligned``) and, as on the CPU, runs its
    per-layer path with the mask instead of a nested tensor."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    mask = torch.tensor([[True, False, False, False, False, False], [False] * 5 + [True]])
    got, want = _run(_encoder(), x, src_key_padding_mask=mask)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_nn_transformer_with_padding_masks():
    torch.manual_seed(0)
    model = torch.nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    src_pad = torch.arange(7)[None, :] >= torch.tensor([7, 4])[:, None]
    got, want = _run(model, src, tgt, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_other_ops_on_a_card_nested_tensor_raise_clearly():
    from torch_spyre.ops import nested

    x = torch.randn(2, 4, 8).to("spyre")
    nt = torch._nested_tensor_from_mask(
        x, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]).bool().to("spyre")
    )
    assert nt.is_nested and nt.device.type == "spyre"
    padded = nt.to_padded_tensor(-1.0, [2, 5, 8]).cpu()
    assert padded.shape == (2, 5, 8) and bool((padded[0, 2:] == -1).all())
    torch.testing.assert_close(padded[1, :4], x.cpu()[1])
    with pytest.raises((RuntimeError, NotImplementedError), match="NestedTensor"):
        nt + 1
    with pytest.raises(ValueError, match="left-aligned"):
        torch._nested_tensor_from_mask(x, torch.tensor([[0, 1, 1, 1]] * 2).bool().to("spyre"))
    assert nested._padded(nt)[1] == [2, 4]
