import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import torch_spyre  # noqa: F401  (registers the device)
from torch_spyre import settings
from torch_spyre.runtime.fallback import SpyreFallbackWarning

warnings.filterwarnings("ignore", category=SpyreFallbackWarning)
# tests import shared helpers from here (benchmark_module)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (for settings read at import time)."""
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


@pytest.fixture
def spyre_python():
    return run_python


@pytest.fixture
def spyre_settings():
    """``spyre_settings(field=value, ...)``: torch_spyre settings for the rest of
    the test (``settings.override``), restored after it."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(settings.override(**changes))
