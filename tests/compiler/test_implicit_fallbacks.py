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


def test_a_static_cache_prefix_reaches_attention_in_place():
    """A static cache's prefill as transformers writes it: the new K and V
    rows copied into the caches in place, then causal SDPA over the first
    ``n`` rows of each (``sdpa_attention_forward`` slices the cache so when
    the mask is skipped).  Compiled, the slices reach the flash program as
    they lie (``_kv_rows_in_place``: no copy kernel of the prefix), and the
    answer and the written caches are the CPU's (fp32)."""
    from torch_spyre.profiler import profile

    def prefill(q, k, v, kc, vc, pos):
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        n = q.shape[2]
        return torch.nn.functional.scaled_dot_product_attention(
            q, kc[:, :, :n], vc[:, :, :n], is_causal=True, enable_gqa=True
        )

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 64, 64, generator=g)
    k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(2))
    kc, vc = (torch.randn(1, 2, 96, 64, generator=g) for _ in range(2))
    pos = torch.arange(64)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = prefill(q, k, v, want_kc, want_vc, pos)
    dev = [t.to("spyre") for t in (q, k, v, kc, vc, pos)]
    compiled = torch.compile(prefill, fullgraph=True, dynamic=False)
    with inductor_config.patch(fx_graph_cache=False), profile() as prof:
        got = compiled(*dev)
    names = [n.name for n in prof.kernels]
    assert "flash_attn_1x8x64x64x64_causal_gqa4_of96" in names, names
    assert not any("slice" in n or "clone" in n for n in names), names
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev[3].cpu(), want_kc, rtol=0, atol=0)
    torch.testing.assert_close(dev[4].cpu(), want_vc, rtol=0, atol=0)
