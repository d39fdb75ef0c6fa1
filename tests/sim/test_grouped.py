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
