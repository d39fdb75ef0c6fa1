"""Reads the stick DMA can express without moving data first: sub-blocks of a
buffer (a KV cache's first positions), one lane of a stick (Inductor's
unrolled small reductions), and indexes that are affine in the loop
variables (transformers' padding mask indexed by aranges)."""

from __future__ import annotations

import torch
import torch._inductor.config

import torch_spyre
from torch_spyre.compiler import scheduling
from torch_spyre.testing import tolerances


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``dtype``: the dtype the device computed in (sets the tolerance)."""
    tol = tolerances(dtype or got.dtype)
    torch.testing.assert_close(got.to(want.dtype), want, **tol, equal_nan=True)


def _compiled(fn, *args):
    torch_spyre.reset_fallback_counts()
    out = torch.compile(fn, fullgraph=True, dynamic=False)(*(a.to("spyre") for a in args))
    assert torch_spyre.fallback_counts() == {}
    return out


def _loads_with_offsets() -> list:
    return [
        s
        for plan in scheduling.PLANS
        for s in plan.program.steps
        if s.kind == "load" and any(getattr(s, "offsets", ()))
    ]


def test_slice_of_inner_dim_reads_a_sub_block() -> None:
    """``cache[:, :, :5]`` of a [1, 3, 64, 64] KV cache is 3 blocks of sticks,
    not one: the kernel reads the whole cache operand from offsets, no copy."""

    def f(cache, q):
        k = cache[:, :, 2:7]
        k = k[:, :, None].expand(1, 3, 3, 5, 64).reshape(1, 9, 5, 64)
        return (q @ k.transpose(-1, -2)) * 0.125

    for dt in (torch.float32, torch.float16):
        cache = torch.randn(1, 3, 64, 64, dtype=dt)
        q = torch.randn(1, 9, 5, 64, dtype=dt)
        scheduling.PLANS.clear()
        # planned now, not replayed from Inductor's cache: the plans are inspected
        with torch._inductor.config.patch(fx_graph_cache=False):
            out = _compiled(f, cache, q)
        assert_close(out.cpu(), f(cache.float(), q.float()).to(dt))
        assert any(s.offsets[2] == 2 for s in _loads_with_offsets())


def test_select_and_stick_aligned_slice() -> None:
    def g(x):
        return x[:, 2] * 2 + x[:, 3, 64:].sum(-1, keepdim=True)

    x = torch.randn(4, 6, 128, dtype=torch.float16)
    assert_close(_compiled(g, x).cpu(), g(x.float()).half())


def test_unrolled_small_reductions_read_single_lanes() -> None:
    """Inductor unrolls reductions over < 8 elements into reads of x[..., i]:
    the stick is loaded once and each lane picked on the vector unit (exact)."""

    def f(x, y):
        s = x + y
        return s.amax(-1, keepdim=True), (s == float("-inf")).logical_not().any(-1), s.sum(-1)

    for dt in (torch.float32, torch.float16):
        x = torch.randn(2, 9, 5, 5, dtype=dt)
        y = torch.randn(5, 5, dtype=dt)
        y[0, 1:] = float("-inf")
        got = _compiled(f, x, y)
        for a, b in zip(got, f(x.float(), y.float())):
            assert_close(a.cpu(), b, dt)


def test_padding_mask_indexed_by_aranges() -> None:
    """transformers builds its mask as ``pad[arange(b), arange(n)] & causal``:
    the aranges are affine indexes, not a gather."""

    def f(x, m):
        b, _, q, n = x.shape
        i = torch.arange(n, device=x.device)
        causal = i[None, :] <= i[-q:, None]
        pad = m.bool()[torch.arange(b, device=x.device)[:, None], i[None, :]]
        allowed = causal[None, None] & pad[:, None, None, :]
        return torch.where(allowed, x, -1e4).softmax(-1)

    x = torch.randn(3, 2, 8, 8)
    m = torch.ones(3, 8, dtype=torch.long)
    m[0, :3] = 0
    m[1, :1] = 0
    assert_close(_compiled(f, x, m).cpu(), f(x, m))


def test_a_matmul_with_k_one_is_a_planned_outer_product(spyre_settings) -> None:
    # a rank-1 product (Mamba-2's dt x B): a broadcast product on the vector
    # unit inside the matmul's program, no degrade step; fp32 is exact here
    spyre_settings(compile_fallback="error")

    def f(a, w, bias):
        return torch.addmm(bias, a, w) * 2, torch.bmm(
            a[None].expand(3, -1, -1), (w[None] + 1).expand(3, -1, -1)
        )

    args = [torch.randn(40, 1), torch.randn(1, 70), torch.randn(70)]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])
    for g, want in zip(got, f(*args)):
        torch.testing.assert_close(g.cpu(), want, rtol=1e-6, atol=1e-6)


def test_a_matmul_over_a_flat_view_reads_the_buffer_in_its_dims(spyre_settings) -> None:
    # the A operand is a [4, 128] view of a [4, 2, 64] buffer read with one
    # variable across its last two dims: split at the dims, no degrade step
    spyre_settings(compile_fallback="error")

    def f(x, w):
        h = (x * 2).permute(1, 0, 2).contiguous()  # [4, 2, 64]
        return h.view(4, 128) @ w

    args = [torch.randn(2, 4, 64), torch.randn(128, 32)]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])
    torch.testing.assert_close(got.cpu(), f(*args), rtol=1e-5, atol=1e-5)
