"""The last degrade step (compiler/host_nodes.py): a node that neither plans
nor maps to FX nodes is computed on the host from Inductor's IR.

Every case refuses planning and the eager path, so each buffer of the graph
goes through the IR writer; the results must equal the CPU in fp32 (the host
code computes with torch on the host: a mismatch is a bug, not rounding)."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

from torch_spyre.compiler import degrade, eager_nodes
from torch_spyre.compiler.scheduling import SpyreScheduling
from torch_spyre.kernels.search import Unsupported
from torch_spyre.runtime import dispatch_stats


@pytest.fixture
def host_only(monkeypatch):
    def refuse_plan(self, nodes, *args, **kwargs):
        raise Unsupported("test refuses planning")

    def refuse_eager(snode):
        raise Unsupported("test refuses eager kernels")

    monkeypatch.setattr(SpyreScheduling, "_plan", refuse_plan)
    monkeypatch.setattr(eager_nodes, "function_source", refuse_eager)
    with fresh_cache():
        torch._dynamo.reset()
        yield


CASES = {
    "broadcast_chain": (lambda x, y: torch.sigmoid(x * 2 + y).clamp(0.2, 0.8), [(3, 70), (70,)]),
    "permute_reshape_mean": (lambda x: x.permute(1, 0, 2).reshape(5, -1).mean(-1), [(4, 5, 6)]),
    "var_of_flip": (lambda x: x.flip(1).var(1), [(3, 9)]),
    "softmax": (lambda x: x.softmax(-1), [(4, 33)]),
    "pad_then_max": (lambda x: F.pad(x, [2, 1], value=-0.5).amax(0), [(6, 5)]),
    "where_mask": (lambda x, y: torch.where(x > y, x, y * 3), [(8, 8), (8, 1)]),
    "argmax": (lambda x: x.argmax(-1), [(5, 17)]),
    "gather_by_index": (lambda x, i: x[i.abs().long() % 4], [(4, 6), (7,)]),
    "scatter_add": (
        lambda x, s: x.index_add(0, torch.tensor([1, 1, 3], device=x.device), s),
        [(4, 6), (3, 6)],
    ),
    "cumsum_free_layer_norm": (
        lambda x, w: F.layer_norm(x.transpose(0, 1), (3,), w, None, 1e-5),
        [(3, 10), (3,)],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nodes_run_on_the_host_from_their_ir(host_only, case):
    fn, shapes = CASES[case]
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g) for s in shapes]
    want = fn(*args)
    before = degrade.counts()["host"]
    dispatch_stats.reset("fallback")
    got = torch.compile(fn, fullgraph=True, dynamic=False)(*[a.to("spyre") for a in args])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    assert degrade.counts()["host"] > before
    assert any(op.startswith("compiled.") for op in dispatch_stats.counts("fallback"))


def test_the_host_step_raises_under_compile_fallback_error(host_only, spyre_settings):
    spyre_settings(compile_fallback="error")
    with pytest.raises(Exception, match="TORCH_SPYRE_COMPILE_FALLBACK=error"):
        torch.compile(lambda x: x.exp() + 1, fullgraph=True)(torch.randn(4, 4).to("spyre"))
