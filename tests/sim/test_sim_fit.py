"""The joint fit of the modelling constants to every published figure is re-run
here (tools/fit.py; docs/hardware-model.md section 5 shows its tables)."""

import math

import pytest

from torch_spyre.hardware import HardwareConfig
from torch_spyre.tools import fit


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in fit.fits()}


def test_fits_are_deterministic_and_pinned(results):
    card = results["card"]
    assert card.values["dram_efficiency"] == pytest.approx(0.6048, abs=2e-3)
    assert card.values["sfu_transcendental_cycles"] == pytest.approx(2.985, abs=0.02)
    q = results["card + GEMV quality"]
    assert q.nuisance["gemv_quality"] == pytest.approx(0.926, abs=5e-3)
    assert q.values["dram_efficiency"] == pytest.approx(0.629, abs=3e-3)
    again = fit.fit("card")
    assert again.values == card.values and again.residuals == card.residuals


def test_every_residual_is_reported_and_the_config_is_near_the_optimum(results):
    now = fit.evaluate(HardwareConfig())
    names = {m.name for m in fit.MEASUREMENTS}
    for r in results.values():
        assert set(r.residuals) == names
        assert r.cost <= fit._cost(now) + 1e-12  # a fit never does worse than where it started
    # the configured constants explain the figures nearly as well as the best fit:
    # 15% more weighted squared log error (0.298 vs 0.259; docs: why they stay)
    best = min(r.cost for r in results.values())
    assert fit._cost(now) == pytest.approx(0.2983, abs=1e-3) and best == pytest.approx(
        0.2586, abs=2e-3
    )
    assert fit._cost(now) <= 1.2 * best
    # the split speedups (the largest residuals) do not move with any constant:
    # kernel structure, not card properties, sets them
    sens = fit.sensitivity()
    for m in fit.MEASUREMENTS:
        if "split" in m.name:
            assert max(abs(v) for v in sens[m.name].values()) < 0.05
            assert math.exp(results["card"].residuals[m.name]) < 0.7


def test_the_per_core_dma_rate_is_not_constrained():
    sens = fit.sensitivity()
    assert all(abs(row["dma_bytes_per_cycle"]) < 1e-6 for row in sens.values())
