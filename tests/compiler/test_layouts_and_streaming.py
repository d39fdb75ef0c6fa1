"""Layout choice by cost (restickify kernels) and rows longer than the LX
streamed in several passes (softmax, log-softmax, layer / RMS norm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_spyre.compiler import layouts, scheduling
from torch_spyre.hardware import HardwareConfig
from torch_spyre.kernels import options
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.profiler import profile
from torch_spyre.sim import estimate, execute
from torch_spyre.testing import tolerances

H = torch.float16
TOL = tolerances(H)
SMALL_LX = 32 * 1024  # rows of 4000 fp32 elements (16 KB) do not fit half of it


def _compile_run(fn, args, lx_bytes=None):
    """Compile afresh (no FX graph cache), run on spyre under the profiler:
    (output on the host, the kernels that ran, the plans made)."""
    torch._dynamo.reset()
    # PLANS is bounded (its oldest half goes past 256 entries): start it empty,
    # or a trim during this compile would hide this compile's plans
    scheduling.PLANS.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), options.planning(lx_bytes=lx_bytes):
        cf = torch.compile(fn, fullgraph=True, dynamic=False)
        with profile() as prof:
            out = cf(*[a.to("spyre") for a in args])
    return out.cpu(), prof.kernels, list(scheduling.PLANS)


def _rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


ROWS = {
    "softmax": (lambda x: torch.softmax(x, -1), 1),
    "log_softmax": (lambda x: torch.log_softmax(x.float(), -1), 1),
    "layernorm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), 3),
    "rmsnorm": (_rms, 2),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_rows_longer_than_the_lx_are_read_twice(name):
    fn, nargs = ROWS[name]
    torch.manual_seed(0)
    x = torch.randn(64, 4000, dtype=H) + (2.0 if name == "layernorm" else 0.0)
    args = [x] + [torch.randn(4000, dtype=H) for _ in range(nargs - 1)]
    ref = fn(*[a.float() for a in args])
    whole, k_whole, p_whole = _compile_run(fn, args)
    out, k_streamed, p_streamed = _compile_run(fn, args, lx_bytes=SMALL_LX)
    torch.testing.assert_close(out.float(), ref.float(), **TOL)
    torch.testing.assert_close(out, whole, rtol=1e-3, atol=1e-3)
    (prog_whole,) = [p.program for p in p_whole]
    (prog,) = [p.program for p in p_streamed]
    cfg = HardwareConfig()
    row_bytes = 64 * 4000 * 2
    # LX-resident rows: the row is read once; streamed: a tile of a row fits
    # the small LX, and the row is read twice (statistics, then normalise)
    assert sum(prog_whole.lx_usage(cfg).values()) > SMALL_LX // 2
    assert sum(prog.lx_usage(cfg).values()) <= SMALL_LX // 2
    x_op = next(u.name for u in p_streamed[0].operands if u.shape == (64, 4000))
    assert sum(1 for s in prog.steps if getattr(s, "operand", None) == x_op) == 2
    assert sum(1 for s in prog_whole.steps if getattr(s, "operand", None) == x_op) == 1
    # at least one more read of the rows (a norm's weight, as long as a row,
    # is re-read per tile of rows too)
    extra = estimate(prog, cfg).dram_bytes - estimate(prog_whole, cfg).dram_bytes
    assert extra >= row_bytes
    # the modelled time reflects the second read
    assert sum(k.time_s for k in k_streamed) > sum(k.time_s for k in k_whole)


def test_softmax_streams_in_two_passes_not_three():
    """The max and the sum share one pass (online, a log-sum-exp reduction)."""
    x = torch.randn(64, 4000, dtype=H)
    out, kernels, plans = _compile_run(lambda x: torch.softmax(x, -1), [x], SMALL_LX)
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), **TOL)
    (prog,) = [p.program for p in plans]
    assert [s.op for s in prog.steps if s.kind == "reduce"] == ["logsumexp"]
    assert sum(1 for s in prog.steps if s.kind == "load") == 2


def _transposed_broadcast(a, z):
    # a [8192, 16] graph input (its last dim fills a quarter of each stick)
    # read transposed by a kernel that re-reads it for every tile of z
    return a.t()[None] * z[:, None, :]


def _reduced_transposed_broadcast(a, z):
    # the same read of a computed [8192, 16] intermediate (a sum over a last dim)
    return a.sum(-1).t()[None] * z[:, None, :]


def _without_layout_choice(fn, args, lx_bytes=None):
    layouts.ENABLED = False
    try:
        return _compile_run(fn, args, lx_bytes)
    finally:
        layouts.ENABLED = True


#: an LX so small that the reader walks ``a`` in tiles inside each row of
#: ``z``, re-reading it (with the whole LX, a core's tile of ``a`` is loaded
#: once and stays: read once, a padded layout costs less than a copy)
READER_LX = 64 << 10


def test_restickify_kernel_when_a_reader_prefers_another_layout():
    torch.manual_seed(0)
    args = [torch.randn(8192, 16, dtype=H), torch.randn(64, 8192, dtype=H)]
    ref = _transposed_broadcast(*[a.float() for a in args])
    n0 = len(layouts.DECISIONS)
    out, kernels, plans = _compile_run(_transposed_broadcast, args, READER_LX)
    torch.testing.assert_close(out.float(), ref, **TOL)
    (decision,) = layouts.DECISIONS[n0:]
    buf, lay, t_default, t_chosen = decision
    # the reader reads a copy with the stick dim along the 8192 positions
    assert lay.stick_dim == 0
    assert lay.num_sticks * 4 == SpyreTensorLayout.default((8192, 16), H).num_sticks
    names = [k.name for k in kernels]
    assert names == [f"restickify_{buf}", plans[-1].program.name]
    assert t_chosen < t_default
    # faster (modelled) than with default layouts only, same values
    out_d, kernels_d, _ = _without_layout_choice(_transposed_broadcast, args, READER_LX)
    assert not any(k.name.startswith("restickify") for k in kernels_d)
    torch.testing.assert_close(out, out_d, rtol=0, atol=0)
    assert sum(k.time_s for k in kernels) < sum(k.time_s for k in kernels_d)


def test_a_tile_read_once_needs_no_restickify():
    """With the whole LX the reader loads its tile of ``a`` once: no copy."""
    torch.manual_seed(0)
    args = [torch.randn(8192, 16, dtype=H), torch.randn(64, 8192, dtype=H)]
    n0 = len(layouts.DECISIONS)
    out, kernels, _ = _compile_run(_transposed_broadcast, args)
    assert layouts.DECISIONS[n0:] == []
    assert not any(k.name.startswith("restickify") for k in kernels)
    torch.testing.assert_close(
        out.float(), _transposed_broadcast(*[a.float() for a in args]), **TOL
    )


def test_producer_stores_an_intermediate_in_the_layout_its_reader_prefers():
    torch.manual_seed(0)
    args = [torch.randn(8192, 16, 32, dtype=H), torch.randn(64, 8192, dtype=H)]
    ref = _reduced_transposed_broadcast(*[a.float() for a in args])
    n0 = len(layouts.DECISIONS)
    out, kernels, plans = _compile_run(_reduced_transposed_broadcast, args)
    torch.testing.assert_close(out.float(), ref, **TOL)
    (decision,) = layouts.DECISIONS[n0:]
    buf, lay, t_default, t_chosen = decision
    assert lay.stick_dim == 0 and t_chosen < t_default
    # written so by its producer, read so by its reader: no restickify
    assert not any(k.name.startswith("restickify") for k in kernels)
    producer, reader = plans
    assert [u.layout for u in producer.operands if u.buffer == buf] == [lay]
    assert [u.layout for u in reader.operands if u.buffer == buf] == [lay]
    out_d, kernels_d, _ = _without_layout_choice(_reduced_transposed_broadcast, args)
    torch.testing.assert_close(out, out_d, rtol=0, atol=0)
    assert sum(k.time_s for k in kernels) < sum(k.time_s for k in kernels_d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_restickify_program_moves_values_exactly(dtype):
    size = (100, 48)
    src = SpyreTensorLayout.default(size, dtype)
    dst = SpyreTensorLayout.with_stick_dim(size, dtype, 0)
    plan = layouts.restickify_plan(src, dst, "x", "y", HardwareConfig())
    prog = plan.program
    assert prog.validate(HardwareConfig())
    host = torch.randn(size).to(dtype)
    bufs = {"in0": src.to_device(host), "ou1": torch.zeros(dst.device_size, dtype=dtype)}
    execute(prog, bufs)
    assert torch.equal(dst.to_host(bufs["ou1"]), host)
    # candidates: the default, and stick dims that take clearly fewer sticks
    assert [c.stick_dim for c in layouts.candidates((256, 16), dtype)] == [1, 0]
    assert [c.stick_dim for c in layouts.candidates(size, dtype)] == [1]  # 96 vs 100 sticks
    assert len(layouts.candidates((64, 128), dtype)) == 1
