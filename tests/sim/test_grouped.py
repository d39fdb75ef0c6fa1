"""Grouped programs (one launch, phases in turn) and stores of sub-blocks."""

import torch

from torch_spyre.ir import GroupedProgram, rebase
from torch_spyre.kernels.basic import elementwise
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import get_card


def _dev(t):
    return SpyreTensorLayout.default(tuple(t.shape), t.dtype).to_device(t).reshape(-1)


def test_store_offsets_write_only_their_block():
    """Two phases of a copy kernel each write a block of rows of one output."""
    card = get_card(0)
    lay = SpyreTensorLayout.default((10, 40), torch.float32)
    phases = []
    for row0, rows in ((0, 3), (5, 4)):
        p = elementwise("copy", (rows, 40), torch.float32, num_inputs=1)
        p = rebase(p, "in0", lay, offsets=(row0, 0))
        p = rebase(p, "out", lay, offsets=(row0, 0))
        phases.append(p)
    gp = GroupedProgram("two_blocks", tuple(phases))
    x = torch.arange(400, dtype=torch.float32).reshape(10, 40)
    out = torch.full((10, 40), -1.0)
    bufs = {"in0": _dev(x), "out": _dev(out)}
    rep = card.run(gp, bufs)
    got = lay.to_host(bufs["out"])
    want = out.clone()
    want[0:3], want[5:9] = x[0:3], x[5:9]
    assert torch.equal(got, want)
    # one launch, then the phases
    parts = [card.estimate(p) for p in phases]
    body = sum(r.time_s - r.launch_s for r in parts)
    assert abs(rep.time_s - (rep.launch_s + body)) < 1e-12
    assert GroupedProgram.from_dict(gp.to_dict()) == gp
    assert "phase 1" in gp.dump() and "at [5, 0]" in gp.dump()


def _copies(blocks, cores=None):
    """Copy-kernel phases, each copying rows ``row0 .. row0 + rows`` of a
    [10, 40] fp32 tensor (``cores``: planned for a card of that many)."""
    from dataclasses import replace

    from torch_spyre.hardware import HardwareConfig

    cfg = HardwareConfig() if cores is None else replace(HardwareConfig(), cores=cores)
    lay = SpyreTensorLayout.default((10, 40), torch.float32)
    phases = []
    for row0, rows in blocks:
        p = elementwise("copy", (rows, 40), torch.float32, num_inputs=1, config=cfg)
        p = rebase(p, "in0", lay, offsets=(row0, 0))
        p = rebase(p, "out", lay, offsets=(row0, 0))
        phases.append(p)
    return tuple(phases)


def test_a_wave_runs_its_phases_at_once_on_their_own_cores():
    """Phases of one wave (disjoint blocks, cores that fit the card together)
    take the slowest one's time, or their bytes at the shared sustained
    bandwidth; the result is the same as in turn."""
    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.sim.grouped import estimate_grouped

    cfg = HardwareConfig()
    card = get_card(0)
    phases = _copies([(0, 3), (5, 4)], cores=16)
    in_turn = GroupedProgram("in_turn", phases)
    at_once = GroupedProgram("at_once", phases, waves=(0, 0))
    at_once.validate(cfg)
    x = torch.arange(400, dtype=torch.float32).reshape(10, 40)
    lay = SpyreTensorLayout.default((10, 40), torch.float32)
    outs = []
    for gp in (in_turn, at_once):
        bufs = {"in0": _dev(x), "out": _dev(torch.full((10, 40), -1.0))}
        card.run(gp, bufs)
        outs.append(lay.to_host(bufs["out"]))
    assert torch.equal(outs[0], outs[1])
    reps = [card.estimate(p) for p in phases]
    body = [r.time_s - r.launch_s for r in reps]
    shared = sum(r.dram_bytes for r in reps) / cfg.sustained_bandwidth_Bps
    t = estimate_grouped(at_once, cfg)
    assert t.time_s == t.launch_s + max(max(body), shared)
    assert t.time_s < estimate_grouped(in_turn, cfg).time_s
    assert t.extra["waves"] == 1 and t.cores_used == sum(r.cores_used for r in reps)
    assert GroupedProgram.from_dict(at_once.to_dict()) == at_once


def test_a_wave_refuses_clashing_blocks_and_too_many_cores():
    import pytest

    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.ir import ProgramError

    cfg = HardwareConfig()
    # rows 0..3 and 2..5 of one output: both write rows 2 and 3
    clash = GroupedProgram("clash", _copies([(0, 4), (2, 4)], cores=4), waves=(0, 0))
    with pytest.raises(ProgramError, match="both touch a block of 'out'"):
        clash.validate(cfg)
    # in turn, the same phases are fine (the second overwrites)
    GroupedProgram("clash", clash.phases, waves=(0, 1)).validate(cfg)
    # two halves of a [128, 256] copy, each planned on the whole card
    lay = SpyreTensorLayout.default((128, 256), torch.float32)
    wide = []
    for row0 in (0, 64):
        p = elementwise("copy", (64, 256), torch.float32, num_inputs=1, cores=cfg.cores)
        wide.append(rebase(rebase(p, "in0", lay, offsets=(row0, 0)), "out", lay, offsets=(row0, 0)))
    assert sum(p.cores_used for p in wide) > cfg.cores
    with pytest.raises(ProgramError, match="run at once on 64 cores"):
        GroupedProgram("wide", tuple(wide), waves=(0, 0)).validate(cfg)
    with pytest.raises(ProgramError, match="waves"):
        GroupedProgram("bad", tuple(wide), waves=(1, 0)).validate(cfg)
