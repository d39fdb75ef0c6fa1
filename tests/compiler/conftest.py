"""Fixtures shared by the compiler tests."""

import pytest
from torch._inductor.utils import fresh_cache

from torch_spyre.compiler.scheduling import SpyreScheduling
from torch_spyre.kernels.search import Unsupported


@pytest.fixture
def refuse(monkeypatch):
    """``refuse("tanh")``: the planner refuses every group holding that op."""
    plan = SpyreScheduling._plan

    def install(op: str):
        def refusing(self, nodes, *args, **kwargs):
            for n in nodes:
                if any(op in str(o.target) for o in n.node.origins or ()):
                    raise Unsupported(f"test refuses {op}")
            return plan(self, nodes, *args, **kwargs)

        monkeypatch.setattr(SpyreScheduling, "_plan", refusing)

    # a graph planned with the refusal must not come back from (or go into)
    # Inductor's FX graph cache, whose key does not know of it
    with fresh_cache():
        yield install
