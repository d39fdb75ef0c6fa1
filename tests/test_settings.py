"""One settings object for every TORCH_SPYRE_* variable (torch_spyre/settings.py)."""

import ast
import os
import pathlib
import re

import pytest

from torch_spyre import settings
from torch_spyre.hardware import HardwareConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_parsed_from_an_environment():
    s = settings.Settings.from_env(
        {
            "TORCH_SPYRE_NUM_CARDS": "4",
            "TORCH_SPYRE_FALLBACK": "Error",
            "TORCH_SPYRE_WARM_PATH": "off",
            "TORCH_SPYRE_VLLM_BUCKETS": "64, 8",
            "TORCH_SPYRE_HW_LX_BYTES": "4MiB",
            "TORCH_SPYRE_CCL_TIMEOUT_S": "2.5",
        }
    )
    assert (s.num_cards, s.fallback, s.warm_path, s.vllm_buckets) == (4, "error", False, (8, 64))
    assert s.hw == {"lx_bytes": "4MiB"} and s.ccl_timeout_s == 2.5
    assert HardwareConfig.from_settings(s).lx_bytes == 4 << 20
    # IBM's name counts when ours is unset
    assert settings.Settings.from_env({"AIU_WORLD_SIZE": "2"}).num_cards == 2
    assert settings.Settings.from_env({}) == settings.Settings()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TORCH_SPYRE_NUM_CARDS": "9"}, "TORCH_SPYRE_NUM_CARDS must be 1..8, got 9"),
        ({"TORCH_SPYRE_NUM_CARDS": "two"}, "TORCH_SPYRE_NUM_CARDS must be an integer"),
        ({"TORCH_SPYRE_FALLBACK": "loud"}, "TORCH_SPYRE_FALLBACK must be one of warn, silent"),
        ({"TORCH_SPYRE_STICK_GEMM": "maybe"}, "TORCH_SPYRE_STICK_GEMM must be 1/on/true"),
        ({"TORCH_SPYRE_VLLM_BUCKETS": "0,16"}, "positive token counts"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(settings.SettingsError, match=message):
        settings.Settings.from_env(env)


def test_read_once_and_changed_through_the_api(monkeypatch):
    before = settings.get()
    monkeypatch.setenv("TORCH_SPYRE_DEBUG", "1")
    assert settings.get() is before  # not read again
    with settings.override(debug=True, fallback="error") as s:
        assert settings.get() is s and s.debug and s.fallback == "error"
        assert os.environ["TORCH_SPYRE_FALLBACK"] == "error"  # children see it
    assert settings.get() == before
    assert "TORCH_SPYRE_FALLBACK" not in os.environ or before.fallback != "error"
    with pytest.raises(settings.SettingsError, match="no setting 'debgu'"):
        settings.update(debgu=True)
    with pytest.raises(settings.SettingsError, match="TORCH_SPYRE_FALLBACK"):
        settings.update(fallback="loud")


def test_public_switches_go_through_the_settings():
    import torch_spyre
    from torch_spyre.runtime import cards
    from torch_spyre.sim import direct

    with settings.override():
        torch_spyre.set_fallback_policy("error")
        assert settings.get().fallback == "error" == torch_spyre.get_fallback_policy()
        prev = direct.set_enabled(False)
        assert prev is True and settings.get().stick_gemm is False and not direct.enabled()
        cards.warm_path(False)
        assert settings.get().warm_path is False
    assert torch_spyre.get_fallback_policy() == settings.get().fallback


def test_only_the_settings_module_reads_the_environment():
    """No other module of the package reads a TORCH_SPYRE_* variable."""
    offenders = []
    for path in (ROOT / "torch_spyre").rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                line = text.splitlines()[node.lineno - 1]
                if "TORCH_SPYRE" in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_docs_table_is_the_settings_table():
    doc = (ROOT / "docs" / "settings.md").read_text()
    got = re.search(r"<!-- settings table.*?-->\n(.*?)<!-- end of settings table -->", doc, re.S)
    assert got is not None and got.group(1) == settings.table()
    assert "docs/settings.md" in (ROOT / "README.md").read_text()
