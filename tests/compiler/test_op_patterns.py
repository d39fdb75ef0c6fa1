"""Ops of production models (IBM's model-op suite, ../shared/clients) planned as
kernel programs: rounding, integer division, products and max with indices,
each compiled under ``compile_fallback=error`` (no degrade step), and the
card's integer range (fp32: exact below 2**24) enforced, never rounded."""

from __future__ import annotations

import pytest
import torch

from torch_spyre.sim.executor import IntegerRangeError


@pytest.fixture(autouse=True)
def _planned(spyre_settings):
    spyre_settings(compile_fallback="error")
    torch._dynamo.reset()


def _compiled(fn, *args):
    return torch.compile(fn, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])


def test_llama4_attention_temperature_floor_log():
    # Ministral 3 / Llama 4: 1 + beta * log(1 + floor(pos / n))
    def scale(pos):
        return 1 + 0.1 * torch.log(1 + torch.floor(pos / 8.0)), pos.ceil() - pos.trunc()

    pos = torch.arange(70, dtype=torch.float32)[None] * 0.75 - 3
    for got, want in zip(_compiled(scale, pos), scale(pos)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_integer_floor_division_and_product():
    # Mistral 3's image sizes: (sizes // patch).prod(-1)
    def grid(sizes):
        return (sizes // 14).prod(-1), sizes // torch.tensor([3, 7]).to(sizes.device)

    sizes = torch.tensor([[1540, 896], [700, 1400], [13, 14]])
    for got, want in zip(_compiled(grid, sizes), grid(sizes)):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_max_with_indices_is_the_first_extreme(dtype):
    # gpt-oss's logits.max(dim=-1, keepdim=True); ties pick the first index
    def f(x):
        v, i = x.max(dim=-1, keepdim=True)
        return x - v, i, x.argmin(-1)

    x = torch.randn(3, 5, 129).to(dtype)
    x[0, 0, 7] = x[0, 0, 90] = 9.0  # a tie: index 7, as the CPU
    for got, want in zip(_compiled(f, x), f(x)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_integers_beyond_the_exact_range_raise_not_round():
    # the vector unit computes in fp32: an int64 sum past 2**24 would be
    # rounded; the card says so instead
    x = torch.full((4, 70), 2**20, dtype=torch.int64)
    with pytest.raises(IntegerRangeError, match="exact only below 2\\*\\*24"):
        _compiled(lambda t: (t * 3).sum(-1), x)


@pytest.mark.parametrize("lo,hi", [(-100, 100), (2**29, 2**30), (-(2**62), 2**62)], ids=str)
def test_eager_integer_division_is_exact(lo, hi):
    # an fp32 quotient refined by its exact integer remainder (ops/adapters.py):
    # a 2**30 dividend's fp32 quotient was off by up to 9 before
    g = torch.Generator().manual_seed(lo & 0xFFFF)
    a = torch.randint(lo, hi, (4, 70), generator=g)
    b = torch.randint(1, 50, (4, 70), generator=g) * (torch.rand(4, 70, generator=g) < 0.5).mul(
        2
    ).sub(1)
    ad, bd = a.to("spyre"), b.to("spyre")
    assert torch.equal((ad // 7).cpu(), a // 7)
    assert torch.equal((ad // bd).cpu(), a // b)
    assert torch.equal(
        torch.div(ad, bd, rounding_mode="trunc").cpu(), torch.div(a, b, rounding_mode="trunc")
    )
    assert torch.equal((ad % bd).cpu(), a % b)


def test_a_cat_of_an_infinite_mask_is_not_a_lane_placement():
    # DeepSeek-V4: the attention mask cat with the compressor's block bias,
    # both filled with -inf.  A lane placement is a matmul with a 0/1 table,
    # and -inf * 0 is NaN: the compiled model answered NaN (a silent wrong
    # answer in the architecture sweep).  Such pieces take the device's cat.
    def fn(x, scores):
        bias = torch.full((4, 3), float("-inf"), device=x.device).triu(1)
        mask = torch.cat([x.masked_fill(x > 0.5, float("-inf")), bias], -1)
        return (scores + mask).softmax(-1), torch.cat([x, bias], -1)

    x, scores = torch.rand(4, 5), torch.randn(4, 8)
    for got, want in zip(_compiled(fn, x, scores), fn(x, scores)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_a_comparison_of_two_constants_folds():
    """BigBird / RoFormer / PhiMoE: a mask from two constant bounds (``ge`` of
    two constants inside a fused group) folds on the host to a bool."""

    def f(x):
        n = x.shape[-1]
        keep = torch.arange(n, device=x.device) >= 3
        both = torch.full_like(x, 1, dtype=torch.bool) & (n > 2) & (n < 50)
        return torch.where(keep & both, x, 0.0), torch.clamp(x, max=float(n < 5))

    x = torch.randn(3, 40)
    for got, want in zip(_compiled(f, x), f(x)):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_exp2_is_exp_of_x_ln2():
    # MPT's ALiBi slopes: 1 / 2 ** (arange(1, n + 1) * 8 / n)
    def f(x):
        return torch.exp2(x) * 0.5

    x = torch.linspace(-20, 20, 96).reshape(2, 48)
    torch.testing.assert_close(_compiled(f, x).cpu(), f(x), rtol=2e-6, atol=0)


@pytest.mark.parametrize("beta", [0.5, 0.0])
def test_baddbmm_is_a_matmul_program(beta):
    """Bloom's ALiBi scores: baddbmm(alibi, q, k, beta, alpha); beta 0 ignores
    its input, NaN included."""

    def f(bias, a, b):
        return torch.baddbmm(bias, a, b, beta=beta, alpha=0.25)

    bias = torch.full((4, 5, 7), float("nan")) if beta == 0 else torch.randn(4, 5, 7)
    args = (bias, torch.randn(4, 5, 6), torch.randn(4, 6, 7))
    torch.testing.assert_close(_compiled(f, *args).cpu(), f(*args), rtol=1e-6, atol=1e-6)


def test_any_unary_aten_op_is_a_vector_op_of_the_program():
    """YOSO's ``acos``: a unary pointwise op Inductor names (``ops.acos``,
    ``ops.atan``, ...) is the eager library's vector op for it, named
    ``aten.<op>:unary`` in the program and resolved in any process (a
    program loaded from Inductor's cache, after the registry was cleared)."""
    from torch_spyre.ir import vector_ops

    def f(x):
        return torch.acos(x) * 2 + torch.atan(x) + torch.log2(x.abs() + 1) + torch.sinh(x)

    x = torch.rand(4, 40) * 2 - 1
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x.to("spyre")).cpu(), f(x), rtol=1e-6, atol=1e-6)
    assert vector_ops.VECTOR_OPS["aten.acos:unary"].cost_class == "transcendental"
    for name in [n for n in vector_ops.VECTOR_OPS if n.endswith(":unary")]:
        del vector_ops.VECTOR_OPS[name]
    torch.testing.assert_close(compiled(x.to("spyre")).cpu(), f(x), rtol=1e-6, atol=1e-6)
