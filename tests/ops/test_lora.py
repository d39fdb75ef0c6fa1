"""Multi-LoRA on the card: the row grouping, the indexed SGMV program, its fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_spyre.ops import lora

SPYRE = torch.device("spyre")
# token -> adapter slot of a mixed batch (-1: base model), 16 rows as a bucket
SLOTS = [0, 2, -1, 2, 3, -1, 0, 0, 1, -1, -1, -1, -1, -1, -1, -1]


def _stacks(slices, k, rank, slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(slots, 1, rank, k, generator=g).to(dtype) for _ in slices]
    b = [(torch.randn(slots, 1, n, rank, generator=g) * 0.1).to(dtype) for n in slices]
    return a, b


def test_group_rows_orders_by_slot_stably():
    counts, rows, inv = lora.group_rows(np.array([2, -1, 0, 2, 0]), 4, 8)
    assert counts == (2, 0, 2, 0)
    assert rows[:4].tolist() == [2, 4, 0, 3]  # slot 0's rows, then slot 2's, in order
    # base-model rows and the padding past the step's rows point at row 4 (none)
    assert inv.tolist() == [2, 4, 0, 3, 1, 4, 4, 4]
    assert lora.runs(counts, rows) == (None, None, None, None)  # 2, 4 and 0, 3: not runs
    counts, rows, _ = lora.group_rows(np.array([1, 1, 0, -1, 3, 3, 3]), 4, 8)
    assert lora.runs(counts, rows) == (2, 0, None, 4)
    with pytest.raises(ValueError, match="slot 4 of 4"):
        lora.group_rows(np.array([4]), 4, 8)


# SLOTS: slots 0 and 2 gathered through the row table, 1 and 3 single rows (runs);
# RUNS: every slot's tokens adjacent (read in place, no row table)
RUNS = [1, 1, 1, -1, 0, 0, 3, 2, 2, 2, 2, -1, -1, -1, -1, -1]


def _card_b(b: list[torch.Tensor], transposed: bool) -> list[torch.Tensor]:
    """The B stacks on the card: as they are, or as vLLM's stacks live there
    (``lora.b_stack``: the view of an [L, 1, r, n] tensor, written through the
    view as vLLM's ``set_lora`` writes a slot)."""
    if not transposed:
        return [t.to(SPYRE) for t in b]
    out = []
    for t in b:
        d = lora.b_stack(t.shape[0], t.shape[2], t.shape[3], t.dtype, SPYRE)
        for e in range(t.shape[0]):
            d[e, 0, :, :].copy_(t[e, 0])
        out.append(d)
    return out


def _run(y, x, slots, a, b):
    """``lora.sgmv_add_`` on the card: y after it, the modelled time it took."""
    out = y.to(SPYRE)
    index = lora.row_index(np.array(slots), 4, 32, SPYRE)
    clock = torch.spyre.modelled_time_s()
    lora.sgmv_add_(out, x.to(SPYRE), index, [t.to(SPYRE) for t in a], b)
    return out.cpu(), torch.spyre.modelled_time_s() - clock


@pytest.mark.parametrize("stored", ["as-is", "transposed"])
@pytest.mark.parametrize("slots", [SLOTS, RUNS], ids=["gathered", "runs"])
@pytest.mark.parametrize(
    "dtype, slices, k",
    [(torch.float32, (128, 64, 64), 128), (torch.float16, (576, 192, 192), 576)],
)
def test_sgmv_matches_the_per_token_loop(stats, dtype, slices, k, slots, stored):
    a, b = _stacks(slices, k, 16, 4, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, k, generator=g).to(dtype)
    y = torch.randn(16, sum(slices), generator=g).to(dtype)
    tokens = torch.tensor(slots)
    want = lora.reference(
        y.float(), x.float(), [t.float() for t in a], [t.float() for t in b], tokens
    )
    card_b = _card_b(b, stored == "transposed")
    stats.reset()
    got, took = _run(y, x, slots, a, card_b)
    assert took > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(got[tokens < 0], y[tokens < 0])  # base-model rows untouched
    # one program for the projection: no gathers, copies or adds around it
    # (nor a copy of a transposed stack into the layout the program reads)
    assert stats.counts("kernel") == {"lora_sgmv": 1}


def test_transposed_b_stacks_read_whole_sticks():
    """A rank-16 fp16 B stack stored [L, 1, n, r] pads each row to a 64-value
    stick; stored transposed the expand reads a quarter of those bytes: the
    same deltas, less device memory and a shorter program."""
    slices, k = (576, 192, 192), 576
    a, b = _stacks(slices, k, 16, 4, torch.float16)
    x, y = torch.randn(16, k).half(), torch.randn(16, sum(slices)).half()
    before = torch.spyre.memory_allocated()
    plain = _card_b(b, False)
    padded = torch.spyre.memory_allocated() - before
    before = torch.spyre.memory_allocated()
    packed = _card_b(b, True)
    assert torch.spyre.memory_allocated() - before == padded // 4
    got_plain, t_plain = _run(y, x, RUNS, a, plain)
    got_packed, t_packed = _run(y, x, RUNS, a, packed)
    # fp16: the expand's tiles differ, so its sums may round differently
    torch.testing.assert_close(got_packed, got_plain, rtol=2e-3, atol=2e-3)
    assert t_packed < t_plain
    print(f"padded {t_plain * 1e6:.2f} us, transposed {t_packed * 1e6:.2f} us")


def test_dead_slots_run_no_phase(stats):
    slices = (128, 64, 64)
    a, b = _stacks(slices, 128, 8, 4, torch.float32)
    x, y = torch.randn(16, 128), torch.randn(16, 256)
    index = lora.row_index(np.array(SLOTS), 4, 32, SPYRE)
    dev_a, dev_b = [t.to(SPYRE) for t in a], [t.to(SPYRE) for t in b]
    # no slot holds weights: nothing runs, y unchanged
    out = y.to(SPYRE)
    lora.sgmv_add_(out, x.to(SPYRE), index, dev_a, dev_b, live=((False,) * 4,) * 3)
    assert torch.equal(out.cpu(), y) and stats.counts("kernel") == {}
    # slot 2 holds no k weights (an adapter on q and v): its k columns get nothing,
    # even though the stack holds values there
    live = ((True,) * 4, (True, True, False, True), (True,) * 4)
    out = y.to(SPYRE)
    lora.sgmv_add_(out, x.to(SPYRE), index, dev_a, dev_b, live=live)
    b_dead = [t.clone() for t in b]
    b_dead[1][2] = 0
    want = lora.reference(y, x, a, b_dead, torch.tensor(SLOTS))
    assert (out.cpu() - want).abs().max() <= 1e-5 * want.abs().max()


def test_expand_only_and_mixed_dtypes_take_the_grouped_program(stats):
    """The embedding's LoRA (x already shrunk) and an fp32 y over fp16 weights
    (the LM head's logits): the grouped program with its gathers."""
    _, b = _stacks((128,), 16, 16, 4, torch.float16)
    x = torch.randn(16, 16).half()
    y = torch.randn(16, 128)
    index = lora.row_index(np.array(SLOTS), 4, 32, SPYRE)
    out = y.to(SPYRE)
    lora.sgmv_add_(out, x.to(SPYRE), index, [], [b[0].to(SPYRE)])
    want = lora.reference(y, x.float(), [], [b[0].float()], torch.tensor(SLOTS))
    assert (out.cpu() - want).abs().max() <= 2e-3 * want.abs().max()
    assert stats.counts("kernel").get("lora_sgmv_grouped") == 1


def test_operands_are_checked():
    a, b = _stacks((128,), 64, 8, 4, torch.float32)
    x, y = torch.randn(16, 128).to(SPYRE), torch.randn(16, 128).to(SPYRE)
    index = lora.row_index(np.array(SLOTS), 4, 32, SPYRE)
    with pytest.raises(RuntimeError, match="against x"):
        lora.sgmv_add_(y, x, index, [a[0].to(SPYRE)], [b[0].to(SPYRE)])


def test_independent_phases_run_in_waves():
    """The shrinks of every (slice, slot) are independent, and so are the
    expands of one slot's slices (disjoint columns) and of different slots
    (distinct tokens: adjacent runs, or disjoint entries of the row table,
    whose entries the program declares distinct): the search packs them into
    waves, phases at once on their own cores, when that is faster."""
    import dataclasses

    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.ir import ProgramError
    from torch_spyre.kernels.lora import sgmv_indexed
    from torch_spyre.sim.grouped import estimate_grouped

    cfg = HardwareConfig()
    slices, k = (576, 192, 192), 576
    live = ((True,) * 4,) * 3
    for starts in ((0, 4, 8, 12), None):
        g = sgmv_indexed((4,) * 4, k, 16, slices, live, torch.float16, tokens=16,
                         starts=starts, bt=True, config=cfg)  # fmt: skip
        assert g.waves and len(g.wave_phases()) < len(g.phases) == 24
        in_turn = dataclasses.replace(g, waves=())  # the same phases one after another
        assert estimate_grouped(g, cfg).time_s < estimate_grouped(in_turn, cfg).time_s
    # gathered: without the table's promise, two slots' expands of one slice
    # could write the same rows, and the waves are refused
    assert g.distinct == ("rows",)
    with pytest.raises(ProgramError, match="both touch a block of 'y'"):
        dataclasses.replace(g, distinct=()).validate(cfg)
