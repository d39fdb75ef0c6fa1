"""Sibling loops in one program (``Program.branches``): a prologue that
contracts its own dim in a loop before the main loops (the output
projection ahead of a decoder layer's MLP, ``kernels.swiglu``).

The loops of each step are dims of the loop order in that order; the
program's text shows the two loops one after the other; the executor runs
them as written; the timing model makes each loop a pipeline of its own and
adds them (a memory-bound loop is not hidden under a compute-bound one that
runs after it)."""

from __future__ import annotations

import pytest
import torch
from sim_helpers import device_buffers

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Buffer, Dim, Load, Matmul, Operand, Program, ProgramError, Reduce, Store
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import SimulatedCard, estimate

H, F = torch.float16, torch.float32
ROWS, J, K, N = 256, 16384, 1024, 512


def _lay(*shape, dtype=H):
    return SpyreTensorLayout.default(shape, dtype)


def _program(first: bool = True, second: bool = True, order=("j", "n")) -> Program:
    """``r = sum_j p[i, j]`` streamed in j tiles (memory-bound: 8 MiB, almost no
    compute) and ``out = a @ w^T`` in n tiles (compute-bound: ``a`` stays), on
    one core; either alone, or both as sibling loops."""
    steps: list = []
    operands: list = []
    buffers: list = []
    if first:
        operands += [Operand("p", _lay(ROWS, J)), Operand("r", _lay(ROWS, dtype=F), "output")]
        buffers += [Buffer("pt", ("i", "j"), H, True), Buffer("rs", ("i",), F)]
        steps += [
            Load("pt", "p", ("i", "j"), ("j",)),
            Reduce("sum", "rs", "pt", "j", ("j",)),
            Store("r", "rs", ("i",)),
        ]
    if second:
        operands += [
            Operand("a", _lay(ROWS, K)),
            Operand("w", _lay(N, K)),
            Operand("out", _lay(ROWS, N, dtype=F), "output"),
        ]
        buffers += [
            Buffer("at", ("i", "k"), H),
            Buffer("wt", ("n", "k"), H, True),
            Buffer("y", ("i", "n"), F, True),
        ]
        steps += [
            Load("at", "a", ("i", "k")),
            Load("wt", "w", ("n", "k"), ("n",)),
            Matmul("y", "at", "wt", ("n",)),
            Store("out", "y", ("i", "n"), ("n",)),
        ]
    return Program(
        "siblings",
        (Dim("i", ROWS), Dim("j", J, 1, 512), Dim("k", K), Dim("n", N, 1, 128)),
        tuple(operands),
        tuple(buffers),
        tuple(steps),
        loop_order=tuple(order),
    )


def test_loops_in_the_order_of_the_nest_are_siblings():
    both = _program()
    both.validate()
    assert both.branches and not _program(second=False).branches
    text = str(both)
    # the j loop closes before the n loop opens, both at the outer level
    lines = [x.strip() for x in text.splitlines()]
    at_j, at_n = lines.index("for j in tiles of 512:"), lines.index("for n in tiles of 128:")
    assert at_j < lines.index("end") < at_n
    # a step looping over a dim the loop order lacks is rejected
    with pytest.raises(ProgramError, match="not in the order of"):
        _program(order=("n",)).validate()


def test_sibling_loops_compute_what_they_say():
    p = _program()
    g = torch.Generator().manual_seed(0)
    pv = torch.randn(ROWS, J, generator=g).to(H)
    a = torch.randn(ROWS, K, generator=g).to(H)
    w = (torch.randn(N, K, generator=g) / 32).to(H)
    bufs = device_buffers(p, p=pv, a=a, w=w)
    SimulatedCard(0).run(p, bufs)
    lay_r, lay_o = p.operand("r").layout, p.operand("out").layout
    r, out = lay_r.to_host(bufs["r"]), lay_o.to_host(bufs["out"])
    torch.testing.assert_close(r, pv.float().sum(1), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(out, a.float() @ w.float().T, rtol=1e-5, atol=1e-4)


def test_sibling_loops_are_pipelines_that_run_one_after_the_other():
    """The memory-bound loop and the compute-bound loop each pipeline their
    own transfers and compute; their times add (less one launch), where one
    pipeline pooling both would hide the first under the second."""
    cfg = HardwareConfig()
    first, second = estimate(_program(second=False), cfg), estimate(_program(first=False), cfg)
    assert first.bottleneck == "memory" and second.bottleneck == "compute"
    both = estimate(_program(), cfg).time_s
    apart = first.time_s + second.time_s - cfg.launch_overhead_s
    assert both == pytest.approx(apart, rel=0.02)
    # about as long as each other: one pool of both loops' work would take
    # about the longer of the two, the sum is nearly twice that
    assert 0.5 < first.time_s / second.time_s < 2
    assert both > 1.6 * max(first.time_s, second.time_s)
