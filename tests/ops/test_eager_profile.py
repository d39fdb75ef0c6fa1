"""An eager forward inside torch_spyre.profiler.profile(): one kernel per op."""

import json

import torch

from torch_spyre.profiler import profile


def test_eager_mlp_shows_one_kernel_per_op(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    ).half()
    x = torch.randn(32, 64, dtype=torch.float16)
    mlp.to("spyre")
    xs = x.to("spyre")
    with profile() as prof:
        y = mlp(xs)
    names = [k.name for k in prof.kernels]
    assert names == ["addmm_32x256x64", "gelu_32x256", "addmm_32x64x256"]
    assert all(k.time_s > 0 for k in prof.kernels)
    assert prof.fallbacks == {}
    assert prof.total_time_s == sum(k.time_s for k in prof.kernels) + sum(
        t.time_s for t in prof.transfers
    )
    torch.testing.assert_close(y.cpu().float(), mlp.cpu().float()(x.float()), rtol=2e-2, atol=2e-2)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("name") == "gelu_32x256" for e in events["traceEvents"])


def test_host_fallbacks_show_as_such_with_their_transfer_cost():
    x = torch.randn(64, 64).to("spyre")
    with profile() as prof:
        torch.median(x)  # no median kernel (histc, used before, now has an adapter)
    assert list(prof.fallbacks) == ["aten.median.default"]
    assert prof.fallbacks["aten.median.default"] > 0
    assert "host fallback" in prof.table()
    kinds = {t.kind for t in prof.transfers if t.label}
    assert kinds == {"d2h", "h2d"}
