import pytest
import torch
from sim_helpers import device_buffers, host_value

from torch_spyre import kernels as K
from torch_spyre.hardware import HardwareConfig
from torch_spyre.sim import SimulatedCard, get_card, reset_cards, trace


def test_run_executes_times_and_advances_clock():
    card = SimulatedCard(0, HardwareConfig())
    p = K.elementwise("mul", (64, 128))
    a, b = torch.randn(64, 128, dtype=torch.float16), torch.randn(64, 128, dtype=torch.float16)
    bufs = device_buffers(p, in0=a, in1=b)
    rep = card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), a * b)
    assert card.clock_s == pytest.approx(rep.time_s)
    rep2 = card.run(p)  # time only
    assert rep2 == rep and card.clock_s == pytest.approx(2 * rep.time_s)
    st = card.stats()
    assert st["kernels"] == 2 and st["kernel_time_s"] == pytest.approx(2 * rep.time_s)


def test_transfers_model_pcie_and_lpddr5():
    cfg = HardwareConfig()
    card = SimulatedCard(2, cfg)
    n = 64 << 20
    h2d = card.record_transfer("h2d", n)
    assert h2d.time_s == pytest.approx(cfg.pcie_latency_s + n / 63.015e9, rel=1e-4)
    assert h2d.start_s == 0 and h2d.card == 2
    d2h = card.record_transfer("d2h", n)
    assert d2h.start_s == pytest.approx(h2d.time_s)
    d2d = card.record_transfer("d2d", n)
    assert d2d.time_s == pytest.approx(2 * n / cfg.sustained_bandwidth_Bps, rel=1e-3)
    st = card.stats()
    assert st["transfers"] == {"h2d": 1, "d2h": 1, "d2d": 1}
    assert st["transfer_bytes"]["h2d"] == n
    assert card.clock_s == pytest.approx(h2d.time_s + d2h.time_s + d2d.time_s)
    with pytest.raises(ValueError, match="h2d"):
        card.record_transfer("p2p", 1)
    card.reset()
    assert card.clock_s == 0 and card.stats()["kernels"] == 0


def test_cards_are_independent_and_emit_trace_records():
    reset_cards()
    seen = []
    trace.add_listener(seen.append)
    try:
        get_card(0).record_transfer("h2d", 1024)
        get_card(1).run(K.elementwise("add", (8, 64)))
    finally:
        trace.remove_listener(seen.append)
    get_card(1).record_transfer("h2d", 1)  # not collected any more
    assert [type(r).__name__ for r in seen] == ["TransferRecord", "KernelRecord"]
    assert seen[0].card == 0 and seen[1].card == 1
    assert get_card(0).clock_s != get_card(1).clock_s
    with pytest.raises(ValueError):
        SimulatedCard(8)
