"""complex64 on the card: interleaved fp32 pairs, element-wise ops as real ops
on the parts (ops/complex_ops.py), eager and compiled; fp32 compared tightly."""

from __future__ import annotations

import pytest
import torch

import torch_spyre
from torch_spyre.ops.complex_ops import ComplexOpError

C = torch.complex64
TIGHT = dict(rtol=1e-5, atol=1e-5)


def _pair(seed: int = 0, shape=(3, 40)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=C, generator=g), torch.randn(*shape, dtype=C, generator=g)


def test_stored_as_interleaved_pairs_16_per_stick():
    a, _ = _pair()
    d = a.to("spyre")
    assert torch.equal(d.cpu(), a)
    assert d.device_tensor_layout().device_size[-1] == 16  # 128-byte sticks of 8-byte pairs
    # view_as_real / view_as_complex are views of the same bytes
    r = torch.view_as_real(d)
    assert r.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    assert torch.equal(r.cpu(), torch.view_as_real(a))
    assert torch.equal(torch.view_as_complex(r).cpu(), a)


@pytest.mark.parametrize(
    "name,f",
    [
        ("mul", lambda p, q: p * q),
        ("add", lambda p, q: p + q),
        ("sub_alpha", lambda p, q: torch.sub(p, q, alpha=2)),
        ("div", lambda p, q: p / q),
        ("abs", lambda p, q: p.abs()),
        ("conj_mul", lambda p, q: p.conj() * q),
        ("conj_copy", lambda p, q: p.conj().clone()),
        ("complex", lambda p, q: torch.complex(p.real, q.imag)),
        ("neg", lambda p, q: -p),
        ("real_scale", lambda p, q: p * 2.5 + q.real[..., :1]),
    ],
)
def test_elementwise_matches_cpu_with_no_host_fallback(name, f):
    a, b = _pair(1)
    torch_spyre.reset_fallback_counts()
    got = f(a.to("spyre"), b.to("spyre"))
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.cpu(), f(a, b), **TIGHT)


def _rope(xq, freqs_cis):
    # Meta's reference Llama / transformers' Llama 4 rotary
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)


def _rope_polar(xq, ang):
    return _rope(xq, torch.polar(torch.ones_like(ang), ang)[None, :, None, :])


def _rope_args():
    x = torch.randn(1, 5, 4, 64, generator=torch.Generator().manual_seed(2))
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    return x, torch.outer(torch.arange(5).float(), inv)


def test_complex_rotary_eager():
    x, ang = _rope_args()
    torch_spyre.reset_fallback_counts()
    got = _rope_polar(x.to("spyre"), ang.to("spyre"))
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.cpu(), _rope_polar(x, ang), **TIGHT)


def test_complex_rotary_compiled(spyre_settings):
    spyre_settings(compile_fallback="error")
    x, ang = _rope_args()
    torch._dynamo.reset()
    torch_spyre.reset_fallback_counts()
    f = torch.compile(_rope_polar, fullgraph=True, dynamic=False)
    got = f(x.to("spyre"), ang.to("spyre"))
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.cpu(), _rope_polar(x, ang), **TIGHT)


def test_an_op_without_a_complex_form_says_so():
    a, _ = _pair()
    d = a.to("spyre")
    with pytest.raises(ComplexOpError, match="aten.exp on complex64"):
        torch.exp(d)
    assert torch.equal(d.cpu(), a)  # untouched
