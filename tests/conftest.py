import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

# The suite's persistent kernel-search cache (runtime/artifact_cache.py): one
# fresh directory per run, shared by the xdist workers and subprocesses (they
# inherit the variable) and removed at the end. A test that counts searches
# must see them run, and CI's runs on one machine would otherwise share hits;
# the cache itself is tested in tests/runtime/test_artifact_cache.py.
# torch_spyre may already be imported (torch's device-backend autoload), its
# settings read: the setting is updated below as well. Inductor's cache stays
# where torch_spyre put it.
_run_cache = None
if "TORCH_SPYRE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _run_cache = tempfile.mkdtemp(prefix="torch-spyre-test-cache-")
    os.environ["TORCH_SPYRE_CACHE_DIR"] = _run_cache
    atexit.register(shutil.rmtree, _run_cache, ignore_errors=True)

import torch_spyre  # noqa: E402, F401  (registers the device)
from torch_spyre import settings  # noqa: E402
from torch_spyre.runtime.fallback import SpyreFallbackWarning  # noqa: E402

if _run_cache is not None or settings.get().cache_dir != os.environ["TORCH_SPYRE_CACHE_DIR"]:
    settings.update(cache_dir=os.environ["TORCH_SPYRE_CACHE_DIR"])

warnings.filterwarnings("ignore", category=SpyreFallbackWarning)
# tests import shared helpers from here (benchmark_module)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Files with whole-model (slow) tests first, most slow tests first; the
    rest after, in collection order.  scripts/test.sh hands xdist files in
    this order (``--no-loadscope-reorder``), so the long files start early and
    the many short ones fill the two workers at the end (xdist's own order,
    most tests first, left the few-but-long files for last, one worker running
    them while the other idled)."""
    slow: dict = {}
    for item in items:
        if item.get_closest_marker("slow"):
            slow[item.path] = slow.get(item.path, 0) + 1
    items.sort(key=lambda item: -slow.get(item.path, 0))  # stable


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
