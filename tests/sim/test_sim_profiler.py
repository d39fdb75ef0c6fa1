import json

import pytest
import torch
from sim_helpers import device_buffers

import torch_spyre.profiler as sprof
from torch_spyre import kernels as K
from torch_spyre.sim import get_card


def _workload():
    card = get_card(0)
    card.record_transfer("h2d", 1 << 20)
    p = K.matmul(256, 512, 512)
    bufs = device_buffers(p, a=torch.randn(256, 512, dtype=torch.float16))
    card.run(p, bufs)
    card.run(K.softmax(512, 1024, cores=1))
    card.run(K.softmax(512, 1024, cores=1))
    card.record_transfer("d2h", 1 << 18)


def test_profile_collects_kernels_and_transfers():
    _workload()  # outside: not collected
    with sprof.profile() as prof:
        _workload()
    assert [k.name for k in prof.kernels] == [
        "mm_256x512x512",
        "softmax_512x1024",
        "softmax_512x1024",
    ]
    assert len(prof.transfers) == 2
    k = prof.kernels[0]
    assert k.cores_used == 32 and k.bottleneck in {"compute", "memory", "ring", "overhead"}
    assert 0 <= k.utilisation <= 1
    total = sum(k.time_s for k in prof.kernels) + sum(t.time_s for t in prof.transfers)
    assert prof.total_time_s == pytest.approx(total)
    table = prof.table()
    assert "softmax_512x1024" in table and "h2d" in table and "total modelled time" in table
    assert "plan" not in table.splitlines()[0]
    # explain: each kernel's planned core grid and tiles (sim.timing.plan_text)
    explained = prof.table(explain=True)
    mm = next(line for line in explained.splitlines() if line.startswith("mm_256x512x512"))
    assert k.report.plan and mm.endswith(k.report.plan)
    assert k.report.plan.startswith(f"{k.cores_used} cores [")


def test_chrome_trace_has_a_track_per_core(tmp_path):
    with sprof.profile() as prof:
        _workload()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {f"core {i}" for i in range(32)} <= names and "transfers" in names
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    mm = [e for e in slices if e["name"] == "mm_256x512x512"]
    assert len({e["tid"] for e in mm}) == 32
    # kernels follow each other on a core's track
    core0 = sorted((e["ts"], e["dur"]) for e in slices if e["tid"] == 1)
    assert all(a[0] + a[1] <= b[0] + 1e-6 for a, b in zip(core0, core0[1:]))


def test_roofline_plot(tmp_path):
    with sprof.profile() as prof:
        _workload()
    path = tmp_path / "roofline.png"
    prof.roofline_plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_roofline_plot_without_matplotlib(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with sprof.profile() as prof:
        _workload()
    with pytest.raises(ImportError, match="pip install matplotlib"):
        prof.roofline_plot(str(tmp_path / "r.png"))


def test_host_issue_and_device_are_separate_tracks():
    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.profiler.profile import HOST_TID

    cfg = HardwareConfig().replace(host_dispatch_s=40e-6, host_descriptor_bytes=0)
    with sprof.profile(cfg) as prof:
        _workload()
    events = prof.chrome_trace()["traceEvents"]
    host = [e for e in events if e.get("cat") == "host"]
    assert [e["name"] for e in host] == [f"issue {k.name}" for k in prof.kernels]
    assert all(e["tid"] == HOST_TID for e in host)
    assert all(e["dur"] == pytest.approx(40.0) for e in host)
    h = prof.host_timeline()
    assert h.kernels == 3 and h.host_issue_s == pytest.approx(120e-6)
    assert h.end_to_end_s >= h.device_s == pytest.approx(sum(k.time_s for k in prof.kernels))
    assert "host path" in prof.table()
