import json

import pytest
import torch

from torch_spyre.hardware import HardwareConfig, HardwareConfigError, parse_size
from torch_spyre.sim import get_card, reset_cards


def test_defaults_reproduce_published_figures():
    c = HardwareConfig()
    assert c.cores == 32 and c.corelets_per_core == 2
    assert c.peak_flops(torch.float16) == pytest.approx(98.304e12)
    assert c.peak_flops(torch.float16, cores=1) == pytest.approx(3.072e12)
    assert c.peak_flops(torch.int8) == pytest.approx(2 * 98.304e12)
    assert c.ridge_point() == pytest.approx(480.0)
    assert c.memory_bandwidth_Bps / c.cores == pytest.approx(6.4e9)
    assert c.lx_bytes == 2 * 2**20 and c.stick_bytes == 128
    assert c.device_memory_bytes == 112 * 2**30
    assert c.per_core_span_bytes == 256 * 2**20
    assert c.pcie_bandwidth_Bps == pytest.approx(63.0e9, rel=1e-3)
    assert c.ring_bandwidth_Bps == pytest.approx(192e9)


def test_parse_size():
    assert parse_size("4MiB") == 4 * 2**20
    assert parse_size("64 KiB") == 65536
    assert parse_size("204.8GB") == pytest.approx(204.8e9)
    assert parse_size("1e-6") == pytest.approx(1e-6)
    assert parse_size(16) == 16
    with pytest.raises(HardwareConfigError, match="cannot parse"):
        parse_size("4 parsecs")


def test_from_env_fields_and_alias(tmp_path):
    env = {"TORCH_SPYRE_HW_CORES": "16", "TORCH_SPYRE_HW_LX_BYTES": "4MiB"}
    c = HardwareConfig.from_env(env)
    assert c.cores == 16 and c.lx_bytes == 4 * 2**20
    assert c.peak_flops() == pytest.approx(98.304e12 / 2)
    c = HardwareConfig.from_env({"TORCH_SPYRE_DEVICE_MEMORY": "64MiB"})
    assert c.device_memory_bytes == 64 * 2**20


def test_from_env_file_json_and_toml(tmp_path):
    j = tmp_path / "hw.json"
    j.write_text(json.dumps({"cores": 8, "memory_bandwidth_Bps": "102.4GB"}))
    c = HardwareConfig.from_env({"TORCH_SPYRE_HW_CONFIG": str(j), "TORCH_SPYRE_HW_CORES": "4"})
    assert c.cores == 4  # the per-field variable beats the file
    assert c.memory_bandwidth_Bps == pytest.approx(102.4e9)
    t = tmp_path / "hw.toml"
    t.write_text('lx_bytes = "1MiB"\nclock_hz = 1.0e9\n')
    c = HardwareConfig.from_env({"TORCH_SPYRE_HW_CONFIG": str(t)})
    assert c.lx_bytes == 2**20 and c.clock_hz == 1e9


def test_validation_errors_are_clear(tmp_path):
    with pytest.raises(HardwareConfigError, match="TORCH_SPYRE_HW_CORSE names no"):
        HardwareConfig.from_env({"TORCH_SPYRE_HW_CORSE": "4"})
    with pytest.raises(HardwareConfigError, match="cores must be positive"):
        HardwareConfig().replace(cores=0)
    with pytest.raises(HardwareConfigError, match="whole number"):
        HardwareConfig().replace(cores="2.5")
    with pytest.raises(HardwareConfigError, match="no field 'core'"):
        HardwareConfig().replace(core=3)
    with pytest.raises(HardwareConfigError, match="dram_efficiency"):
        HardwareConfig().replace(dram_efficiency=1.5)
    with pytest.raises(HardwareConfigError, match="cannot read"):
        HardwareConfig.from_env({"TORCH_SPYRE_HW_CONFIG": str(tmp_path / "missing.json")})


def test_get_card_reads_environment(spyre_settings):
    spyre_settings(device_memory="64MiB")
    reset_cards()
    assert get_card(0).config.device_memory_bytes == 64 * 2**20
    assert get_card(3).index == 3 and get_card(0) is get_card(0)
    reset_cards(HardwareConfig(cores=4))
    assert get_card(1).config.cores == 4
    with pytest.raises(ValueError, match="0..7"):
        get_card(8)
