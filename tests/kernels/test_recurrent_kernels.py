"""The recurrent kernel programs (kernels/recurrent.py): they validate, the
search picks their fastest plan, and the timesteps cost the same."""

from __future__ import annotations

import pytest
import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import ProgramError
from torch_spyre.kernels import recurrent as rk
from torch_spyre.sim import estimate

CFG = HardwareConfig()


def test_the_search_picks_the_fastest_step():
    split, tile_n = rk.best_step_plan("lstm", 16, 256, 256, torch.float16, config=CFG)
    best = estimate(
        rk.recurrent_step("lstm", 16, 256, 256, 2, 0, torch.float16, split=split,
                          tile_n=tile_n, config=CFG),
        CFG,
    ).time_s  # fmt: skip
    for other in [(1, 1), (2, 2), (4, 1)]:
        p = rk.recurrent_step("lstm", 16, 256, 256, 2, 0, torch.float16, split=other, config=CFG)
        assert best <= estimate(p, CFG).time_s


def test_the_input_projection_is_one_program_for_every_step_and_gate():
    p = rk.best_input_projection(32, 8, 64, 4, 128, torch.float16, config=CFG)
    p.validate(CFG)
    rep = estimate(p, CFG)
    # 2 T B I G H flops, all on the PE array, in one launch
    assert rep.flops == pytest.approx(2 * 32 * 8 * 64 * 4 * 128)
    assert [o.name for o in p.operands] == ["x", "w", "bias", "out"]


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_every_timestep_costs_the_same_and_streams_the_recurrent_weights(mode):
    g = rk.GATES[mode]
    reps = [
        estimate(rk.recurrent_step(mode, 4, 64, 64, 10, t, torch.float16, masked=True), CFG)
        for t in (0, 9)
    ]
    assert reps[0].time_s == reps[1].time_s
    # a step reads all of W_hh (the state changes every step: nothing to reuse)
    assert reps[0].dram_bytes >= g * 64 * 64 * 2
    assert reps[0].flops == pytest.approx(2 * 4 * 64 * 64 * g)


def test_a_projection_is_an_lstm_option():
    with pytest.raises(ProgramError, match="LSTM option"):
        rk.recurrent_step("gru", 4, 64, 16, 3, 0, proj=True)
    with pytest.raises(ProgramError, match="H elements"):
        rk.recurrent_step("gru", 4, 64, 16, 3, 0)
    p = rk.recurrent_step("lstm", 4, 128, 16, 3, 0, proj=True, split=(1, 2))
    p.validate(CFG)
    # the hidden units split over cores leave partial projections, joined on the ring
    assert any(type(s).__name__ == "RingAllReduce" for s in p.steps)
