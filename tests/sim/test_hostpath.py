"""The host-path timeline (sim/hostpath.py): exact on small cases."""

import pytest

from torch_spyre.hardware import HardwareConfig
from torch_spyre.sim import hostpath

CFG = HardwareConfig().replace(
    host_dispatch_s=10e-6, host_descriptor_bytes=0, pcie_latency_s=1e-6, host_sync_s=5e-6
)


def test_device_bound_async_issue_overlaps():
    # the host issues every 10 us, each kernel takes 100 us: only the first
    # issue and the doorbell are exposed
    t = hostpath.timeline([100e-6] * 4, CFG)
    assert t.device_s == pytest.approx(400e-6)
    assert t.end_to_end_s == pytest.approx(10e-6 + 1e-6 + 400e-6 + 5e-6)
    assert not t.host_bound and t.host_issue_s == pytest.approx(40e-6)


def test_host_bound_async_issue_sets_the_pace():
    # kernels of 2 us issued every 10 us: the card waits for the host
    t = hostpath.timeline([2e-6] * 5, CFG)
    assert t.end_to_end_s == pytest.approx(5 * 10e-6 + 1e-6 + 2e-6 + 5e-6)
    assert t.host_bound and t.idle_s == pytest.approx(t.end_to_end_s - 10e-6)


def test_synchronous_runtime_adds_host_and_device():
    t = hostpath.timeline([100e-6] * 3, CFG.replace(host_async=0))
    assert t.end_to_end_s == pytest.approx(3 * (10e-6 + 1e-6 + 100e-6) + 5e-6)


def test_descriptors_cross_pcie():
    cfg = CFG.replace(host_descriptor_bytes=63_000)
    per = 10e-6 + 63_000 / cfg.pcie_bandwidth_Bps
    assert hostpath.issue_cost(cfg) == pytest.approx(per)


def test_dispatch_for_inverts_the_timeline():
    ks = [50e-6] * 100
    d = hostpath.dispatch_for(ks, 20e-3, CFG)
    assert hostpath.timeline(ks, CFG.replace(host_dispatch_s=d)).end_to_end_s == pytest.approx(
        20e-3, rel=1e-6
    )
    # faster than the device alone: no host cost reproduces it
    assert hostpath.dispatch_for(ks, 1e-3, CFG) is None


def test_host_parameters_come_from_the_environment():
    cfg = HardwareConfig.from_env({"TORCH_SPYRE_HW_HOST_DISPATCH_S": "0.001"})
    assert cfg.host_dispatch_s == 1e-3
