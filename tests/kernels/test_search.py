"""The one kernel search (kernels/search.py): what every builder's plan search does."""

import pytest
import torch

from torch_spyre import kernels
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import ProgramError
from torch_spyre.kernels.search import Found, Memo, NoPlan, Search, Unsupported, search
from torch_spyre.sim import estimate

CFG = HardwareConfig()


def _elementwise(rows: int):
    return kernels.elementwise("add", (rows, 256), torch.float16, config=CFG)


def test_keeps_the_fastest_and_the_first_of_a_tie():
    found = search([64, 512, 128], _elementwise, CFG)
    assert found.candidate == 64
    assert found.time_s == estimate(_elementwise(64), CFG).time_s
    # the same program twice: the earlier candidate stays
    tie = search([("a", 64), ("b", 64)], lambda c: _elementwise(c[1]), CFG)
    assert tie.candidate == ("a", 64)


def test_margin_keeps_an_earlier_candidate_within_it():
    times = {"slow": 2.0, "fast": 1.5}
    build = lambda c: c  # noqa: E731
    s = Search(build, CFG, validate=False, cost=times.__getitem__, margin=0.6)
    assert s.run(["slow", "fast"]).candidate == "slow"
    s = Search(build, CFG, validate=False, cost=times.__getitem__, margin=0.4)
    assert s.run(["slow", "fast"]).candidate == "fast"


def test_rejected_candidates_are_skipped_and_the_first_reason_kept():
    def build(c):
        if c < 0:
            raise ProgramError(f"candidate {c} does not fit")
        return _elementwise(c)

    assert search([-1, 64, -2], build, CFG).candidate == 64
    with pytest.raises(NoPlan, match="candidate -1 does not fit") as err:
        search([-1, -2], build, CFG, "two bad ones")
    assert "two bad ones" in str(err.value) and str(err.value.first) == "candidate -1 does not fit"
    # a program the card rejects at validation: LX far too small
    tiny = HardwareConfig(lx_bytes=4096)
    big = kernels.matmul(512, 4096, 4096, torch.float16, split=(1, 1, 1), tiles=(512, 4096, 4096))
    with pytest.raises(NoPlan):
        search([0], lambda _: big, tiny)


def test_first_fit_costs_nothing_and_a_baseline_must_be_beaten():
    costed = []

    def cost(p):
        costed.append(p)
        return estimate(p, CFG).time_s

    s = Search(_elementwise, CFG, cost=cost, first_fit=True)
    assert s.run([512, 64]).candidate == 512 and costed == []
    base = Found(None, None, 0.0)  # nothing is faster than 0 s
    s = Search(_elementwise, CFG, baseline=base)
    assert s.run([64, 128]).candidate is None and s.tried == 2


def test_fits_filters_built_results():
    s = Search(_elementwise, CFG, fits=lambda p: p.dims[0].size > 100)
    assert s.run([64, 128, 512]).candidate in (128, 512)


def test_memo_computes_once_and_remembers_errors():
    memo = Memo(limit=2)
    calls = []

    def compute(v):
        calls.append(v)
        if v < 0:
            raise Unsupported(f"no plan for {v}")
        return v * 2

    assert memo.get(1, lambda: compute(1)) == 2 and memo.get(1, lambda: compute(1)) == 2
    for _ in range(2):
        with pytest.raises(Unsupported, match="no plan for -1"):
            memo.get(-1, lambda: compute(-1), remember=(Unsupported,))
    assert calls == [1, -1]
    for k in range(5):  # bounded
        memo.get(k + 10, lambda k=k: k)
    assert len(memo) <= 3


def test_builders_use_it():
    """best_matmul, best_flash_attention and best_swiglu_mlp return the program
    the search picked: no other candidate of theirs is faster."""
    p = kernels.best_matmul(64, 1024, 512, config=CFG)
    t = estimate(p, CFG).time_s
    for split in [(1, 1, 1), (2, 2, 1), (1, 4, 2)]:
        other = kernels.matmul(64, 1024, 512, split=split, config=CFG)
        assert t <= estimate(other, CFG).time_s
