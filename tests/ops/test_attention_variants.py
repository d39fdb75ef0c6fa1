"""Variants of the flash-attention program: soft-capping, sinks, MQA, MLA head sizes."""

import math

import pytest
import torch

from torch_spyre import kernels
from torch_spyre.runtime import dispatch_stats
from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.sim import get_card
from torch_spyre.testing import tolerances


def S(t):
    return None if t is None else t.to("spyre")


def _eager(q, k, v, mask, scale, causal, softcap, sinks):
    """The variants as transformers' eager attention functions write them
    (Gemma-2's soft-cap, GPT-OSS's sinks: an extra softmax column, dropped)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    w = q @ k.transpose(-1, -2) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    n, m = w.shape[-2:]
    if causal:
        w = w.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, n, 1)
        w = torch.cat([w, col], -1)
        w = w - w.max(-1, keepdim=True).values
        return w.softmax(-1)[..., :-1] @ v
    return w.softmax(-1) @ v


CASES = [
    # hq, hk, d, dv, softcap, sinks, causal, mask
    (4, 2, 16, 16, 50.0, False, True, False),  # Gemma-2: GQA + soft-cap
    (4, 4, 32, 16, None, False, True, False),  # MLA: V head smaller than Q/K's
    (4, 1, 16, 16, None, True, False, True),  # MQA + sinks + a padding mask
    (8, 2, 32, 32, 30.0, True, True, False),  # everything at once
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_variants_match_the_eager_formulas(case, dtype):
    hq, hk, d, dv, cap, sink, causal, use_mask = case
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, hq, 9, d, generator=g), torch.randn(2, hk, 9, d, generator=g)
    v = torch.randn(2, hk, 9, dv, generator=g)
    mask = None
    if use_mask:
        mask = torch.rand(2, 1, 9, 9, generator=g) > 0.3
        mask[..., 0] = True
    sinks = torch.randn(hq, generator=g) if sink else None
    scale = 1 / math.sqrt(d)
    want = _eager(q, k, v, mask, scale, causal, cap, sinks)
    dispatch_stats.reset()
    with fallback_policy("error"):
        got = torch.ops.spyre.attention_ext(
            S(q.to(dtype)), S(k.to(dtype)), S(v.to(dtype)), S(mask), scale, causal, cap or 0.0,
            S(sinks),
        ).cpu()  # fmt: skip
    assert dispatch_stats.counts("kernel").get("attention") == 1  # the flash program
    torch.testing.assert_close(got.float(), want, **tolerances(dtype))


def test_sdpa_with_one_kv_head_and_a_smaller_v_runs_the_flash_program():
    """Falcon's multi-query SDPA call (one KV head, broadcast) and DeepSeek-V3's MLA
    call (V head 16 against Q/K 32) take the flash program, not the math path."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 7, 32, generator=g), torch.randn(1, 1, 7, 32, generator=g),
               torch.randn(1, 1, 7, 16, generator=g))  # fmt: skip
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    dispatch_stats.reset()
    got = torch.nn.functional.scaled_dot_product_attention(S(q), S(k), S(v), is_causal=True)
    assert dispatch_stats.counts("kernel").get("attention") == 1
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float32))


def test_soft_cap_costs_vector_work_only():
    card = get_card(0)
    plain = card.estimate(kernels.flash_attention(1, 8, 8, 512, 512, 64, causal=True))
    capped = card.estimate(
        kernels.flash_attention(1, 8, 8, 512, 512, 64, causal=True, softcap=50.0)
    )
    assert capped.dram_bytes == plain.dram_bytes and capped.flops == plain.flops
    assert max(capped.busy_s["vector"]) > max(plain.busy_s["vector"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_causal_prefill_over_a_cache_prefix_reads_it_in_place(dtype):
    """``sdpa(q, cache[:, :, :n], ...)`` (transformers' causal prefill into an
    empty StaticCache slices the cache so): the flash program reads the first
    ``n`` rows of each head where they lie, with no re-laid copy of the
    prefix, and answers as the CPU does; a prefix of another tensor's rows
    (not at offset 0) is re-laid and read as before."""
    from torch_spyre.profiler import profile

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 64, 128, generator=g).to(dtype)
    kc, vc = (torch.randn(1, 2, 96, 128, generator=g).to(dtype) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kc[:, :, :64].float(), vc[:, :, :64].float(), is_causal=True, enable_gqa=True
    )
    qd, kd, vd = S(q), S(kc), S(vc)
    with profile() as prof:
        got = torch.nn.functional.scaled_dot_product_attention(
            qd, kd[:, :, :64], vd[:, :, :64], is_causal=True, enable_gqa=True
        )
    assert [k.name for k in prof.kernels] == ["flash_attn_1x8x64x64x128_causal_gqa4_of96"]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(got.cpu().float(), want, **tol)
    # rows 16..79: not a prefix, a copy first (and the same answer)
    with profile() as prof:
        got = torch.nn.functional.scaled_dot_product_attention(
            qd, kd[:, :, 16:80], vd[:, :, 16:80], is_causal=True, enable_gqa=True
        )
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kc[:, :, 16:80].float(), vc[:, :, 16:80].float(), is_causal=True,
        enable_gqa=True,
    )  # fmt: skip
    assert "flash_attn_1x8x64x64x128_causal_gqa4" in [k.name for k in prof.kernels]
    torch.testing.assert_close(got.cpu().float(), want, **tol)
