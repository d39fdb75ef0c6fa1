"""Eager ops run as kernel programs on the card and match the CPU."""

import pytest
import torch
import torch.nn.functional as F

from torch_spyre.runtime import cards, launch
from torch_spyre.testing import tolerances

DTYPES = [torch.float32, torch.float16]


def _check(spyre_out, ref, dtype):
    torch.testing.assert_close(spyre_out.cpu(), ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_broadcasting_and_scalars(dtype, stats):
    a = torch.randn(7, 59, dtype=dtype)
    b = torch.randn(59, dtype=dtype)
    sa, sb = a.to("spyre"), b.to("spyre")
    _check(sa + sb, a + b, dtype)
    _check(sa * 2.5 - 1, a * 2.5 - 1, dtype)
    _check(torch.where(sa > 0, sa, sb), torch.where(a > 0, a, b), dtype)
    _check(F.gelu(sa, approximate="tanh"), F.gelu(a, approximate="tanh"), dtype)
    _check(F.silu(sa), F.silu(a), dtype)
    _check(torch.clamp(sa, min=-0.5, max=0.5), torch.clamp(a, -0.5, 0.5), dtype)
    assert torch.equal((sa > sb).cpu(), a > b)
    assert set(stats.counts("fallback")) == set()
    assert stats.counts("kernel")


def test_mixed_dtypes_promote_like_torch():
    a = torch.randn(4, 5, dtype=torch.float16)
    b = torch.randn(4, 5, dtype=torch.float32)
    out = a.to("spyre") + b.to("spyre")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), a + b)
    i = torch.arange(20).view(4, 5)
    torch.testing.assert_close((i.to("spyre") * 0.5).cpu(), i * 0.5)


def test_in_place_and_out_variants_on_views():
    x = torch.randn(6, 80)
    y = x.to("spyre")
    y[1:4, 10:50].mul_(3).add_(1)
    x[1:4, 10:50].mul_(3).add_(1)
    torch.testing.assert_close(y.cpu(), x)
    out = torch.empty(0, device="spyre")
    torch.exp(y, out=out)
    torch.testing.assert_close(out.cpu(), torch.exp(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (7, 59), (3, 4, 130), (1000,), (3, 70000)])
def test_reductions(dtype, shape, stats):
    x = torch.randn(shape, dtype=dtype)
    s = x.to("spyre")
    _check(s.sum(), x.sum(), dtype)
    _check(s.sum(-1), x.sum(-1), dtype)
    _check(s.mean(0, keepdim=True), x.mean(0, keepdim=True), dtype)
    _check(s.amax(-1), x.amax(-1), dtype)
    _check(s.var(-1), x.var(-1), dtype)
    assert torch.equal(s.argmax(-1).cpu(), x.argmax(-1))
    v, i = s.max(-1)
    _check(v, x.max(-1).values, dtype)
    assert torch.equal(i.cpu(), x.max(-1).indices)
    if x.dim() > 1:
        _check(s.sum((0, -1)), x.sum((0, -1)), dtype)
    assert stats.counts("fallback") == {}


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_family(dtype, stats):
    a, b = torch.randn(37, 70, dtype=dtype), torch.randn(70, 130, dtype=dtype)
    bias = torch.randn(130, dtype=dtype)
    sa, sb, sbias = a.to("spyre"), b.to("spyre"), bias.to("spyre")
    _check(sa @ sb, a @ b, dtype)
    _check(torch.addmm(sbias, sa, sb), torch.addmm(bias, a, b), dtype)
    _check(
        torch.addmm(sbias, sa, sb, beta=0.5, alpha=2),
        torch.addmm(bias, a, b, beta=0.5, alpha=2),
        dtype,
    )
    w = torch.randn(50, 70, dtype=dtype)
    x3 = torch.randn(2, 5, 70, dtype=dtype)
    _check(F.linear(x3.to("spyre"), w.to("spyre")), F.linear(x3, w), dtype)
    p, q = torch.randn(4, 9, 33, dtype=dtype), torch.randn(4, 33, 17, dtype=dtype)
    _check(torch.bmm(p.to("spyre"), q.to("spyre")), torch.bmm(p, q), dtype)
    assert stats.counts("fallback") == {}


def test_transposed_weight_and_reshaped_activation_are_read_in_place():
    w = torch.randn(64, 128).to("spyre")
    x = torch.randn(2, 8, 128).to("spyre")
    before = cards.card(0).stats()["transfer_bytes"]["d2d"]
    F.linear(x, w)
    assert cards.card(0).stats()["transfer_bytes"]["d2d"] == before  # no re-layout


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_norms(dtype, stats):
    x = torch.randn(2, 3, 130, dtype=dtype) * 3
    s = x.to("spyre")
    w, b = torch.randn(130, dtype=dtype), torch.randn(130, dtype=dtype)
    _check(torch.softmax(s, -1), torch.softmax(x, -1), dtype)
    _check(torch.log_softmax(s, 1), torch.log_softmax(x, 1), dtype)
    _check(
        F.layer_norm(s, (130,), w.to("spyre"), b.to("spyre")), F.layer_norm(x, (130,), w, b), dtype
    )
    _check(F.rms_norm(s, (130,), w.to("spyre")), F.rms_norm(x, (130,), w), dtype)
    assert stats.counts("fallback") == {}


def test_movement_ops(stats):
    x = torch.randn(4, 70)
    s = x.to("spyre")
    assert torch.equal(torch.cat([s, s], 0).cpu(), torch.cat([x, x], 0))
    assert torch.equal(torch.stack([s, s]).cpu(), torch.stack([x, x]))
    assert torch.equal(s.flip(0).cpu(), x.flip(0))
    assert torch.equal(torch.triu(s).cpu(), torch.triu(x))
    assert torch.equal(torch.roll(s, 3, 1).cpu(), torch.roll(x, 3, 1))
    assert torch.equal(F.pad(s, (1, 2)).cpu(), F.pad(x, (1, 2)))
    idx = torch.tensor([3, 0, 2])
    assert torch.equal(s.index_select(0, idx.to("spyre")).cpu(), x.index_select(0, idx))
    assert torch.equal(s[idx.to("spyre")].cpu(), x[idx])
    torch.testing.assert_close(s.cumsum(1).cpu(), x.cumsum(1))
    emb = torch.nn.Embedding(10, 8)
    ids = torch.tensor([[1, 2], [3, 9]])
    ref = emb(ids)
    emb.to("spyre")
    assert torch.equal(emb(ids.to("spyre")).cpu(), ref)
    assert stats.counts("fallback") == {}


def test_adapters(stats):
    x = torch.randn(5, 100) * 10
    s = x.to("spyre")
    torch.testing.assert_close(torch.sin(s).cpu(), torch.sin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cos(s).cpu(), torch.cos(x), rtol=1e-5, atol=1e-5)
    a = torch.randint(-100, 100, (50,))
    b = torch.randint(1, 9, (50,)) * torch.where(torch.rand(50) > 0.5, 1, -1)
    sa, sb = a.to("spyre"), b.to("spyre")
    for mode in ("floor", "trunc"):
        assert torch.equal(
            torch.div(sa, sb, rounding_mode=mode).cpu(), torch.div(a, b, rounding_mode=mode)
        )
    assert torch.equal((sa % sb).cpu(), a % b)
    assert torch.equal(torch.fmod(sa, sb).cpu(), torch.fmod(a, b))
    v, i = torch.sort(s, dim=1)
    rv, ri = torch.sort(x, dim=1, stable=True)
    assert torch.equal(v.cpu(), rv) and torch.equal(i.cpu(), ri)
    v, i = torch.topk(s, 5)
    rv, ri = torch.topk(x, 5)
    assert torch.equal(v.cpu(), rv) and torch.equal(i.cpu(), ri)
    assert {"sin", "cos", "div", "remainder", "fmod", "sort", "topk"} <= {
        k.split(".")[0] for k in stats.counts("adapter")
    }
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        sa // torch.zeros_like(sa)


def test_adapter_registry_gives_reasons():
    from torch_spyre.ops.adapters import ADAPTERS

    assert {"sin", "cos", "floor_divide", "sort", "topk"} <= set(ADAPTERS)
    assert all(a.reason for a in ADAPTERS.values())


def test_kernel_cache_hits_on_repeat():
    a = torch.randn(32, 32).to("spyre")
    launch.clear_cache()
    a + a
    a + a
    a + a
    info = launch.cache_info()
    assert info["misses"] == 1 and info["hits"] == 2


def test_kernels_advance_the_modelled_clock():
    a = torch.randn(256, 256).to("spyre")
    card = cards.card(0)
    k0, t0 = card.stats()["kernels"], torch.spyre.modelled_time_s()
    a @ a
    assert card.stats()["kernels"] == k0 + 1
    assert torch.spyre.modelled_time_s() > t0


def test_too_long_rows_for_non_combinable_reductions_fall_back(stats):
    x = torch.randn(2, 300000)
    assert torch.equal(x.to("spyre").argmax(-1).cpu(), x.argmax(-1))
    assert "argmax.default" in stats.counts("fallback")
