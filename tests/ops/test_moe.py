"""Mixture-of-experts on the card: grouping, the grouped kernel program, _grouped_mm."""

import pytest
import torch

import torch_spyre
from torch_spyre.kernels.moe import grouped_swiglu
from torch_spyre.ops import moe
from torch_spyre.runtime import cards
from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.sim import get_card
from torch_spyre.testing import tolerances


def S(t):
    return t.to("spyre")


def _layer(t=9, h=64, i=128, e=4, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).softmax(-1)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.1).to(dtype)
    return x, idx, w, w13, w2


def test_grouping_is_a_counting_sort():
    ids = torch.tensor([2, 0, 2, 3, 0, 2])
    rows, counts = moe.group_by_expert(S(ids), 5)
    assert counts.cpu().tolist() == [2, 0, 3, 1, 0]
    # stable: expert 0's slots (1, 4) take rows 0, 1; expert 2's (0, 2, 5) rows 2..4
    assert rows.cpu().tolist() == [2, 0, 3, 5, 1, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_experts_match_the_experts_loop(dtype):
    x, idx, w, w13, w2 = _layer(dtype=dtype)
    want = moe._reference(x.float(), idx, w, w13.float(), w2.float(), "silu")
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = torch.ops.spyre.moe_experts(S(x), S(idx), S(w), S(w13), S(w2), "silu").cpu()
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got.float(), want, **tolerances(dtype))


def test_grouped_program_costs_what_routing_costs():
    """One phase per expert that got tokens: a dropped expert's weights are never
    read; crowding the tokens on one expert makes its phase longer; the kernel
    is one launch plus the phases."""
    cfg = cards.config(0)
    card = get_card(0)

    def t(counts):
        return card.estimate(grouped_swiglu(counts, 256, 512, torch.float16, config=cfg))

    spread, dropped = t((4, 4, 4, 4)), t((8, 8, 0, 0))
    assert len(grouped_swiglu((8, 8, 0, 0), 256, 512, torch.float16).phases) == 2
    assert dropped.time_s < spread.time_s  # two experts' weights fewer
    assert dropped.dram_bytes < spread.dram_bytes
    prefill_even = t((64, 64, 64, 64))
    prefill_crowded = t((256, 0, 0, 0))
    one = t((256,))
    assert prefill_crowded.time_s == pytest.approx(one.time_s)
    # crowding: fewer weights read but one long phase; the phases add up
    rep = t((64, 64, 64, 64))
    body = rep.extra["phase_time_s"]
    assert rep.time_s == pytest.approx(cfg.launch_overhead_s + body)
    assert prefill_even.launch_s == cfg.launch_overhead_s


def test_grouped_mm_matches_the_loop():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(11, 64, generator=g)
    wt = torch.randn(3, 96, 64, generator=g)  # [E, N, K]: transformers passes its transpose
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    want = torch.zeros(11, 96)
    start = 0
    for e, end in enumerate(offs.tolist()):
        want[start:end] = a[start:end] @ wt[e].T
        start = end
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = torch._grouped_mm(S(a), S(wt).transpose(-2, -1), offs=S(offs)).cpu()
        got2 = torch._grouped_mm(S(a), S(wt.transpose(-2, -1).contiguous()), offs=S(offs)).cpu()
    torch.testing.assert_close(got, want, **tolerances(torch.float32))
    torch.testing.assert_close(got2, want, **tolerances(torch.float32))


def test_mm_into_a_row_slice():
    a, b = torch.randn(5, 32), torch.randn(32, 16)
    out = S(torch.zeros(9, 16))
    with fallback_policy("error"):
        torch.mm(S(a), S(b), out=out[2:7])
    want = torch.zeros(9, 16)
    want[2:7] = a @ b
    torch.testing.assert_close(out.cpu(), want, **tolerances(torch.float32))


def test_grouped_mm_splits_columns_when_a_core_span_is_exceeded(monkeypatch):
    """The stacked experts layout interleaves the experts inside each row of
    sticks: a large expert's phase can address more than a core's span (Gemma 4
    26B-A4B's gate_up at decode: 483 MiB). The op then plans blocks of fewer
    output columns, on the card, and the result is the same."""
    import dataclasses

    from torch_spyre.runtime import launch

    card = get_card(0)
    monkeypatch.setattr(
        card, "config", dataclasses.replace(card.config, per_core_span_bytes=96 << 10)
    )
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 64, generator=g)
    wt = torch.randn(8, 448, 64, generator=g)  # [E, N, K]
    offs = torch.tensor([1, 1, 2, 2, 3, 3, 3, 3], dtype=torch.int32)
    want = torch.zeros(3, 448)
    for row, e in enumerate((0, 2, 4)):
        want[row] = a[row] @ wt[e].T
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = torch._grouped_mm(S(a), S(wt).transpose(-2, -1), offs=S(offs)).cpu()
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got, want, **tolerances(torch.float32))
    keys = [k for k in launch._cache if k[0] == "grouped_mm" and k[3:5] == (64, 448)]
    rejected = [k for k in keys if launch._cache[k].program is None]
    used = [k for k in keys if launch._cache[k].program is not None]
    assert rejected and "span" in launch._cache[rejected[0]].info["rejected"]
    assert used and used[0][-1] is not None and used[0][-1] < 448  # column blocks
