"""The executor's kept host views of device memory (sim/hostviews.py) are never stale.

A view is kept once an operand has been read twice; every test here reads a
"weight" until it is kept, writes it through one writer path, and reads it
back through a kernel: the result must be the CPU's.  A stale view would be
a silently wrong answer.
"""

import pytest
import torch

from torch_spyre.sim import direct
from torch_spyre.sim.hostviews import VIEWS


@pytest.fixture(autouse=True)
def big_budget():
    """Room for every view (the default budget scales with device memory in
    use), and matmuls that read their weights through the views: by default
    they read a weight in place instead (sim/direct.py, tests/sim/test_direct_gemm.py)."""
    prev = direct.set_enabled(False)
    VIEWS.set_budget(1 << 30)
    yield
    VIEWS.set_budget(1.0)
    direct.set_enabled(prev)


def _kept(dw: torch.Tensor, dx: torch.Tensor) -> None:
    """Read dw as a matmul operand until its host view is kept."""
    before = VIEWS.stats()["entries"]
    for _ in range(3):
        dx @ dw.T
    assert VIEWS.stats()["entries"] > before
    hits = VIEWS.hits
    dx @ dw.T
    assert VIEWS.hits > hits  # now served from the view


def _check(dw: torch.Tensor, w: torch.Tensor, dx: torch.Tensor, x: torch.Tensor) -> None:
    assert torch.equal(dw.cpu(), w)  # what device memory holds
    got = (dx @ dw.T).cpu()  # what a kernel reads
    torch.testing.assert_close(got, (x.float() @ w.float().T).half(), rtol=2e-3, atol=2e-3)


def _weights():
    w = torch.randn(256, 512).half()
    x = torch.randn(4, 512).half()
    return w, w.to("spyre"), x, x.to("spyre")


def _on(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return v.to(t.device)


# each writer does the same to the CPU tensor and to the spyre tensor
WRITERS = {
    # host -> device copies into the whole tensor, a slice and a strided view
    "copy_whole": lambda t: t.copy_(torch.linspace(-1, 1, 256 * 512).view(256, 512)),
    "setitem_rows": lambda t: t.__setitem__(slice(3, 9), 1.5),
    "setitem_col": lambda t: t[:, 7].fill_(-2),
    # device -> device copy
    "copy_d2d": lambda t: t.copy_(t.flip(0)),
    # kernels writing in place: the fast elementwise runner and the general
    # executor (a broadcast operand)
    "add_": lambda t: t.add_(1),
    "mul_tensor_": lambda t: t.mul_(t),
    "add_broadcast_": lambda t: t.add_(_on(t, torch.arange(512).half() / 512)),
    # the DMA ops: scatters by offsets and through the generic path
    "index_copy_": lambda t: t.index_copy_(
        0, _on(t, torch.tensor([0, 9])), _on(t, torch.ones(2, 512).half())
    ),
    "index_put_": lambda t: t.index_put_(
        (_on(t, torch.tensor([4])),), _on(t, torch.tensor(3.0).half())
    ),
    "masked_fill_": lambda t: t.masked_fill_(t > 1, 0.0),
    # a host fallback's result written back (sort has no device kernel)
    "fallback_result": lambda t: t.copy_(t.sort(-1).values),
    "zero_": lambda t: t.zero_(),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_invalidates(writer):
    w, dw, x, dx = _weights()
    _kept(dw, dx)
    WRITERS[writer](w)
    WRITERS[writer](dw)
    _check(dw, w, dx, x)


def test_resize_relinearizes_and_invalidates():
    w, dw, x, dx = _weights()
    _kept(dw, dx)
    dw.resize_(257, 512)  # grows: the storage is re-laid as linear, then regrown
    dw[256].fill_(0)
    dw.resize_(256, 512)
    _check(dw.contiguous(), w, dx, x)


def test_param_data_swap_and_freed_blocks_are_not_confused():
    """A freed weight's view must not serve a new tensor at the same address."""
    w, dw, x, dx = _weights()
    _kept(dw, dx)
    del dw
    w2 = torch.randn(256, 512).half()
    dw2 = w2.to("spyre")  # likely the same address: a new block id
    _check(dw2, w2, dx, x)
    lin = torch.nn.Linear(512, 256, bias=False).half().to("spyre")
    for _ in range(3):
        lin(dx)
    new = torch.randn(256, 512).half()
    lin.weight.data = new.to("spyre")
    torch.testing.assert_close(
        lin(dx).cpu(), (x.float() @ new.float().T).half(), rtol=2e-3, atol=2e-3
    )


def test_compiled_kernel_sees_writes():
    w, dw, x, dx = _weights()
    f = torch.compile(lambda a, b: torch.relu(a @ b.T) + 1, dynamic=False)
    for _ in range(3):
        f(dx, dw)
    dw.mul_(-1)
    w.mul_(-1)
    want = torch.relu(x.float() @ w.float().T).half() + 1
    torch.testing.assert_close(f(dx, dw).cpu(), want, rtol=3e-3, atol=3e-3)


def test_views_do_not_change_numbers():
    """The same kernels with views kept or with none give identical bits."""
    w, dw, x, dx = _weights()
    VIEWS.set_budget(None)
    ref = [(dx @ dw.T).cpu() for _ in range(3)]
    VIEWS.set_budget(1 << 30)
    got = [(dx @ dw.T).cpu() for _ in range(4)]
    assert all(torch.equal(ref[0], g) for g in ref + got)
    assert VIEWS.hits


def test_budget_bounds_the_views_and_they_can_be_dropped():
    VIEWS.set_budget(600_000)  # room for one fp32 [256, 512] view (524 KB)
    a, da, x, dx = _weights()
    b, db, _, _ = _weights()
    for _ in range(3):
        dx @ da.T
        dx @ db.T
    s = VIEWS.stats()
    assert s["entries"] == 1 and s["bytes"] <= 600_000
    torch.spyre.empty_cache()
    assert VIEWS.stats()["entries"] == 0
