"""Matmul tilings the plan search tries (kernels/plan.py ``_TILINGS``).

A prefill projection whose PE time is close to its memory roof (M=1024 K=4096
N=12800: 1092 us of PE work against 1170 us of compulsory bytes) reaches the
roof only if it moves no more than the compulsory bytes.  Streaming k in
128-wide tiles re-reads a core's activation rows once per column tile; an
activation-stationary plan (k tile = the core's whole k) loads them once and
streams the weight's column tiles past them.
"""

from __future__ import annotations

import torch

from torch_spyre.compiler import scheduling
from torch_spyre.ir import Load
from torch_spyre.sim import timing_only
from torch_spyre.testing import tolerances

H = torch.float16


def _plan(m: int, k: int, n: int, execute: bool):
    torch._dynamo.reset()
    scheduling.PLANS.clear()
    torch.manual_seed(0)
    x, w = torch.randn(m, k, dtype=H), torch.randn(k, n, dtype=H) / k**0.5
    with torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(lambda a, b: a @ b, fullgraph=True, dynamic=False)
        if execute:
            out = fn(x.to("spyre"), w.to("spyre")).cpu()
        else:
            with timing_only():
                out = fn(x.to("spyre"), w.to("spyre"))
    (plan,) = scheduling.PLANS
    return plan.program, x, w, out


def _activation_load(prog):
    (a,) = [s for s in prog.steps if isinstance(s, Load) and s.operand == "in0"]
    return a


def test_the_activation_is_loaded_once_per_core_and_the_values_are_right():
    """A tile that covers its dims is loaded outside the loops it does not
    walk (``_fit``), and the plan computes the product."""
    prog, x, w, out = _plan(512, 2048, 6400, execute=True)
    dims = {d.name: d for d in prog.dims}
    a = _activation_load(prog)
    # the k tile is the core's whole k, and the activation load is outside
    # every loop: one load per core, kept while the weight's columns stream
    k = next(d for d in a.index if d is not None and d != prog.loop_order[0])
    assert dims[k].tile_size == dims[k].core_extent
    assert a.loops == ()
    torch.testing.assert_close(out, (x.float() @ w.float()).to(H), **tolerances(H))


def test_the_projection_moves_only_its_compulsory_bytes():
    from torch_spyre.sim import estimate

    prog, *_ = _plan(1024, 4096, 12800, execute=False)
    compulsory = (1024 * 4096 + 4096 * 12800 + 1024 * 12800) * 2
    assert estimate(prog, None).dram_bytes == compulsory
    a = _activation_load(prog)
    assert a.loops == ()
    # whole-k tiles: 16 cores over rows x 2 over k, each core's k (2048) in
    # one tile (k over 32 cores in 128-wide tiles moves the same bytes, 1.4
    # us slower: its ring all-reduce is over 32 cores, not 2)
    dims = {d.name: d for d in prog.dims}
    k = next(d for d in a.index if d is not None and d != prog.loop_order[0])
    assert dims[k].cores == 2 and dims[k].tile_size == dims[k].core_extent == 2048
