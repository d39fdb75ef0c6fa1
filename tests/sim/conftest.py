import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_cards(monkeypatch):
    """Every test sees default hardware and fresh process-wide cards."""
    for key in list(__import__("os").environ):
        if key.startswith("TORCH_SPYRE_HW_") or key == "TORCH_SPYRE_DEVICE_MEMORY":
            monkeypatch.delenv(key)
    from torch_spyre.sim import reset_cards

    reset_cards()
    yield
    reset_cards()
