"""Every graph lowers alike, however many a process lowered before it
(``compiler/implicit_fallbacks.py``).

Inductor makes a custom op's fallback the first time it lowers the op, and
from then on realizes the op's multi-user inputs early: without the spyre
pass's ``prepare``, the first compile of a graph in a process planned other
programs than every later compile of the same graph (Granite-3.3-8B's
prefill: 1.398x of the compute floor in a fresh process, 1.411x after an
earlier compile, which CI saw and a developer's run did not)."""

import re

import torch
from torch._inductor import config as inductor_config
from torch._inductor import lowering
from torch._inductor.utils import run_and_get_code


@torch.library.custom_op("spyre_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


def _fn(a, b):
    # an input of the custom op with several reads and a second user, a view:
    # realized early, the view's reader became a program of its own
    y = a * b.cos() + b * a.sin()
    return scaled(y), y.t().contiguous()


def _programs(a, b) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        out, (code,) = run_and_get_code(
            torch.compile(_fn, fullgraph=True), a.to("spyre"), b.to("spyre")
        )
    return re.findall(r"\.run\(.*\)  # (\w+)", code), out


def test_a_custom_op_lowers_alike_in_the_first_and_a_later_compile():
    op = torch.ops.spyre_test.scaled.default
    lowering.lowerings.pop(op, None)  # as in a fresh process
    lowering.needs_realized_inputs.discard(op)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    first, out1 = _programs(a, b)
    assert op in lowering.lowerings and op not in lowering.needs_realized_inputs
    later, out2 = _programs(a, b)
    assert first == later
    # one program stores y and its transposed copy
    assert len(first) == 1 and "clone" in first[0], first
    want = _fn(a, b)
    for got in (out1, out2):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


def test_inductor_still_adds_fallbacks_to_needs_realized_inputs():
    """The Inductor behaviour ``prepare`` undoes: if this fails, Inductor
    changed, and implicit_fallbacks.py must be looked at again."""
    op = torch.ops.spyre_test.scaled.default
    saved = lowering.lowerings.pop(op, None)
    try:
        lowering.make_fallback(op, warn=False)
        assert op in lowering.needs_realized_inputs
        assert callable(lowering.tag_to_layout_constraint)
    finally:
        lowering.needs_realized_inputs.discard(op)
        if saved is not None:
            lowering.lowerings[op] = saved
