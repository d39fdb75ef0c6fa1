"""Graph sub-passes are checked (compiler/checked_passes.py): a rewrite that
Inductor's fake propagation rejects is dropped for that graph, the graph
restored, the other sub-passes kept; the compile degrades instead of raising.

These also fail if ``torch._inductor.fx_utils.FakeTensorUpdater`` (the
Inductor internal the check runs) changes its constructor or
``incremental_update``."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import fresh_cache
from torch.fx.experimental.proxy_tensor import make_fx

from torch_spyre.compiler import checked_passes, degrade, passes

aten = torch.ops.aten


def _graph():
    def fn(x):
        return (x * 2).view(32) + 1

    return make_fx(fn, tracing_mode="fake")(torch.randn(4, 8))


def _transposed_mul(gm: torch.fx.GraphModule) -> bool:
    """``x * 2`` as ``(x.T.contiguous() * 2).T`` (permutes): the same values,
    strides (1, 4), which the ``view(32)`` reading it cannot take."""
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    x, val = mul.args[0], mul.meta["val"]
    with gm.graph.inserting_before(mul):
        t = gm.graph.call_function(aten.permute.default, (x, [1, 0]))
        c = gm.graph.call_function(
            aten.clone.default, (t,), {"memory_format": torch.contiguous_format}
        )
        m = gm.graph.call_function(aten.mul.Tensor, (c, 2))
        back = gm.graph.call_function(aten.permute.default, (m, [1, 0]))
    t.meta["val"] = aten.permute.default(x.meta["val"], [1, 0])
    c.meta["val"] = aten.clone.default(t.meta["val"], memory_format=torch.contiguous_format)
    m.meta["val"] = aten.mul.Tensor(c.meta["val"], 2)
    back.meta["val"] = aten.permute.default(m.meta["val"], [1, 0])
    assert back.meta["val"].stride() != val.stride()
    mul.replace_all_uses_with(back)
    gm.graph.erase_node(mul)
    return True


def _add_to_sub(gm: torch.fx.GraphModule) -> bool:
    """A rewrite that propagates: ``+ 1`` as ``- (-1)``."""
    (add,) = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    with gm.graph.inserting_before(add):
        sub = gm.graph.call_function(aten.sub.Tensor, (add.args[0], -1))
    sub.meta["val"] = add.meta["val"]
    add.replace_all_uses_with(sub)
    gm.graph.erase_node(add)
    return True


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_sub_pass_that_does_not_propagate_is_dropped_and_the_others_kept():
    gm = _graph()
    before = _targets(gm)
    degrade.reset_counts()
    changed = checked_passes.run(gm, [("transposed mul", _transposed_mul), ("sub", _add_to_sub)])
    assert changed
    # the mul is back as it was, the add became a sub, the graph still runs
    assert _targets(gm) == [aten.sub.Tensor if t is aten.add.Tensor else t for t in before]
    gm.graph.lint()
    gm.recompile()
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x), (x * 2).view(32) + 1, rtol=0, atol=0)
    assert degrade.counts()["pass"] == 1
    ((what, reason),) = gm.meta[checked_passes.DROPPED]
    assert "'transposed mul' is dropped" in what and "view" in reason


def test_sub_passes_that_propagate_run_as_one_unit():
    gm = _graph()
    degrade.reset_counts()
    assert checked_passes.run(gm, [("sub", _add_to_sub)])
    assert aten.sub.Tensor in _targets(gm) and degrade.counts()["pass"] == 0
    assert checked_passes.DROPPED not in gm.meta
    assert not checked_passes.run(gm, [("nothing", lambda g: False)])


@pytest.fixture
def bad_sub_pass(monkeypatch):
    """The spyre graph pass with a first sub-pass whose rewrite Inductor cannot
    propagate (the kind of bug the --wide sweep found in the fusions)."""

    def bad(gm):
        muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
        if not muls:
            return False
        # the flattening (a reshape after AOT) read as a view, as if the
        # product were contiguous, then the product made not so
        for n in muls[0].users:
            if n.target is aten.reshape.default:
                n.target = aten.view.default
        return _transposed_mul(gm)

    monkeypatch.setattr(passes, "SUB_PASSES", (("test transposed mul", bad), *passes.SUB_PASSES))
    with fresh_cache():  # the cache key does not know of the patch
        yield


def test_a_compile_whose_graph_pass_breaks_degrades_and_matches(bad_sub_pass):
    def fn(x):
        return (x * 2).view(32).softmax(-1) + 1

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    degrade.reset_counts()
    with pytest.warns(degrade.SpyreCompileWarning, match="'test transposed mul' is dropped"):
        out = torch.compile(fn, fullgraph=True, dynamic=False)(x.to("spyre"))
    torch.testing.assert_close(out.cpu(), fn(x), rtol=1e-6, atol=1e-6)
    assert degrade.counts()["pass"] == 1


def test_error_mode_refuses_a_dropped_pass(bad_sub_pass, spyre_settings):
    spyre_settings(compile_fallback="error")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="TORCH_SPYRE_COMPILE_FALLBACK=error") as err:
        torch.compile(lambda a: (a * 2).view(32) + 1, fullgraph=True)(torch.randn(4, 8).to("spyre"))
    assert "'test transposed mul' is dropped" in str(err.value)


@pytest.mark.slow
def test_helium_compiles_when_a_fusion_misjudges_a_layout(monkeypatch):
    """The bug the --wide sweep found, put back: the RoPE/head-split fusion
    stores Helium's head split heads-first under a reader that views its
    token-major strides.  The projections fusion is dropped for the graph
    and the model still compiles and matches the CPU."""
    from torch_spyre.compiler import rope_match
    from torch_spyre.tools.archsweep import configs, run

    monkeypatch.setattr(rope_match, "layout_free", lambda t: True)
    (mt,) = [m for m in configs.model_types() if m.name == "helium"]
    with fresh_cache():
        row = run.run_type(mt, compile=True, wide=True)
    assert row.compiled.verdict == "match", row
    assert row.compiled.degraded.get("pass", 0) >= 1, row
