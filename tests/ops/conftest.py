import pytest

from torch_spyre.runtime import dispatch_stats


@pytest.fixture
def stats():
    dispatch_stats.reset()
    yield dispatch_stats
    dispatch_stats.reset()
