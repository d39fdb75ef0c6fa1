"""histc / bincount / isin on integers run as kernels of the card (no host fallback)."""

import pytest
import torch

import torch_spyre
from torch_spyre.runtime.fallback import fallback_policy


def S(t):
    return t.to("spyre")


@pytest.fixture(autouse=True)
def _no_fallback():
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        yield
    assert torch_spyre.fallback_counts() == {}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_histc_as_transformers_calls_it(dtype):
    """transformers' MoE helper: histc(expert_ids.int(), bins=E, min=0, max=E-1); the
    CPU has no integer histc, so the reference is the float form it uses on the CPU."""
    ids = torch.randint(0, 6, (37,), generator=torch.Generator().manual_seed(0)).to(dtype)
    for lo, hi, bins in ((0, 5, 6), (0, 6, 6), (1, 4, 3), (0, 0, 4)):
        got = torch.histc(S(ids), bins=bins, min=lo, max=hi).cpu()
        want = torch.histc(ids.float(), bins=bins, min=lo, max=hi)
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype)), (lo, hi, bins)


def test_float_histc_matches_cpu():
    x = torch.randn(500, generator=torch.Generator().manual_seed(1))
    for kw in ({"bins": 7, "min": -1.0, "max": 1.5}, {"bins": 13}, {"bins": 4, "min": 0, "max": 0}):
        assert torch.equal(torch.histc(S(x), **kw).cpu(), torch.histc(x, **kw)), kw


def test_bincount_counts_and_weights():
    x = torch.randint(0, 9, (50,), generator=torch.Generator().manual_seed(2))
    w = torch.rand(50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.bincount(S(x)).cpu(), torch.bincount(x))
    assert torch.equal(torch.bincount(S(x), minlength=20).cpu(), torch.bincount(x, minlength=20))
    got = torch.bincount(S(x), S(w), minlength=12).cpu()
    torch.testing.assert_close(got, torch.bincount(x, w, minlength=12))
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(S(torch.tensor([1, -1])))


def test_isin_every_overload():
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(4))
    eos = torch.tensor([2, 7, 31])
    assert torch.equal(torch.isin(S(ids), S(eos)).cpu(), torch.isin(ids, eos))
    assert torch.equal(torch.isin(S(ids), S(eos), invert=True).cpu(), ~torch.isin(ids, eos))
    assert torch.equal(torch.isin(S(ids), 7).cpu(), torch.isin(ids, 7))
    assert torch.equal(torch.isin(7, S(eos)).cpu(), torch.isin(7, eos))
    assert torch.equal(
        torch.isin(S(ids), S(eos[:0])).cpu(), torch.zeros_like(ids, dtype=torch.bool)
    )


def test_integer_max_and_min_of_int64():
    """An uneven core split pads an int64 reduction with the type's extremes (was inf)."""
    x = torch.tensor([5, 7, 9] * 8)
    assert int(S(x).min()) == 5 and int(S(x).max()) == 9
    assert int(S(-x).amax()) == -5
