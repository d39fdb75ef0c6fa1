"""The degrade path (compiler/degrade.py): planning never aborts a compile.

A fused group that does not plan is split, a node that still does not plan
runs as eager kernels inside the compiled graph, each step counted, and
``compile_fallback=error`` turns the steps into errors."""

import pytest
import torch

from torch_spyre.compiler import degrade
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats

F32 = torch.float32


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False)


def test_a_node_that_does_not_plan_runs_as_eager_kernels(refuse):
    refuse("tanh")
    x = torch.randn(64, 96)
    y = torch.randn(64, 96)

    def fn(a, b):
        c = a * 2 + b  # plans
        d = torch.tanh(c.sum(-1, keepdim=True))  # refused: eager
        return (c - d).softmax(-1)  # plans

    degrade.reset_counts()
    dispatch_stats.reset("degraded")
    with pytest.warns(degrade.SpyreCompileWarning, match="runs as eager kernels: test refuses"):
        out = _compile(fn)(x.to("spyre"), y.to("spyre"))
    torch.testing.assert_close(out.cpu(), fn(x, y), rtol=1e-5, atol=1e-6)
    got = degrade.counts()
    assert got["eager"] >= 1 and got["split"] >= 1
    assert sum(dispatch_stats.counts("degraded").values()) >= 1
    # the planned parts are still kernel programs
    with profile() as prof:
        _compile(fn)(x.to("spyre"), y.to("spyre"))
    assert any(k.name.startswith("fused_") for k in prof.kernels)


def test_split_keeps_the_rest_of_the_group_fused(refuse):
    """A reduction fused with its consumer: the half that plans stays one kernel."""
    refuse("tanh")
    x = torch.randn(64, 96)

    def fn(a):
        return torch.tanh(a - (a * 3).sum(-1, keepdim=True))

    degrade.reset_counts()
    with profile() as prof:
        out = _compile(fn)(x.to("spyre"))
    torch.testing.assert_close(out.cpu(), fn(x), rtol=1e-5, atol=1e-6)
    assert degrade.counts()["split"] == 1 and degrade.counts()["eager"] == 1
    assert [k.name for k in prof.kernels if k.name.startswith("fused_")] == ["fused_mul_sum_op0"]


def test_error_mode_raises_with_the_reason(refuse, spyre_settings):
    refuse("tanh")
    spyre_settings(compile_fallback="error")
    x = torch.randn(8, 64).to("spyre")
    with pytest.raises(Exception, match="TORCH_SPYRE_COMPILE_FALLBACK=error") as err:
        _compile(lambda a: torch.tanh(a) * 2)(x)
    assert "test refuses tanh" in str(err.value)


def test_real_unplanned_ops_compile_and_match():
    """Ops with no fused program of their own yet (the degrade path serves
    them inside the graph) compile and match the CPU."""
    cls = torch.randn(1, 1, 64)
    x = torch.randn(2, 16, 64)
    cases = [
        (lambda c, t: torch.cat([c.expand(t.shape[0], 1, t.shape[2]), t], dim=1), (cls, x)),
        (lambda t: t.prod(-1), (torch.rand(4, 64) + 0.5,)),
    ]
    for fn, args in cases:
        out = _compile(fn)(*[a.to("spyre") for a in args])
        torch.testing.assert_close(out.cpu(), fn(*args), rtol=1e-5, atol=1e-6)
