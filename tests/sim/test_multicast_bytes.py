"""A multicast load is shared by the cores of its group that read it: a core
with no rows moves nothing, so the others read the whole tile between them
(five rows over four cores once charged a quarter of the weight to no core:
a 5 x 4096 x 4096 projection read 25.2 of its 33.6 MB, faster than the
sustained bandwidth allows)."""

from __future__ import annotations

import torch

from torch_spyre.sim import KernelRecord, trace


def test_a_short_row_split_still_reads_the_whole_weight():
    x = torch.randn(5, 4096, dtype=torch.float16).to("spyre")
    w = torch.randn(4096, 4096, dtype=torch.float16).to("spyre")
    f = torch.compile(lambda a, b: a @ b.t(), dynamic=False)
    f(x, w)
    records: list = []
    trace.add_listener(records.append)
    try:
        f(x, w)
    finally:
        trace.remove_listener(records.append)
    (mm,) = [r.report for r in records if isinstance(r, KernelRecord)]
    weight = 4096 * 4096 * 2
    assert mm.dram_bytes >= weight
    # and no faster than the weight at the card's sustained bandwidth
    from torch_spyre.runtime import cards

    cfg = cards.config()
    assert mm.time_s >= weight / cfg.sustained_bandwidth_Bps
