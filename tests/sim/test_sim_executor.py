"""Hand-built programs give the numbers torch gives on the CPU.

Tolerances: the executor accumulates in fp32 and rounds once to fp16, as the
reference does, so results agree to about one fp16 rounding.  torch's fp16
defaults (rtol 1e-3 ~ 1 ulp = 2^-10, atol 1e-5) hold for elementwise ops.
Matmuls and reductions sum in a different order than the reference, which in
fp32 can move a value across an fp16 rounding boundary (1 ulp) and leaves
absolute error ~K * 2^-24 * max|term| on outputs that cancel to ~0: those use
atol 1e-3.
"""

import pytest
import torch
from sim_helpers import device_buffers, host_value

from torch_spyre import kernels as K
from torch_spyre.ir import Buffer, Dim, Load, Operand, Program, Store, Vector
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import SimulatedCard, execute

MM_TOL = {"rtol": 1e-3, "atol": 1e-3}


@pytest.fixture
def card():
    return SimulatedCard(0)


@pytest.mark.parametrize("shape", [(300, 200), (64,), (3, 5, 130), (1, 1)])
def test_elementwise_add(card, shape):
    torch.manual_seed(0)
    a, b = torch.randn(shape, dtype=torch.float16), torch.randn(shape, dtype=torch.float16)
    p = K.elementwise("add", shape)
    bufs = device_buffers(p, in0=a, in1=b)
    card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), a + b)


@pytest.mark.parametrize("op,ref", [("exp", torch.exp), ("silu", torch.nn.functional.silu)])
def test_elementwise_unary(card, op, ref):
    x = torch.randn(100, 70, dtype=torch.float16)
    p = K.elementwise(op, (100, 70), num_inputs=1, cores=4)
    bufs = device_buffers(p, in0=x)
    card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), ref(x.float()).half())


@pytest.mark.parametrize(
    "m,n,k,split",
    [
        (256, 384, 512, None),
        (100, 200, 300, (4, 2, 1)),
        (64, 128, 512, (1, 2, 4)),
        (1, 4096, 4096, None),
        (50, 70, 300, (1, 1, 4)),
        (64, 64, 4096, "best"),
    ],
)
def test_matmul(card, m, n, k, split):
    torch.manual_seed(1)
    a, b = torch.randn(m, k, dtype=torch.float16), torch.randn(k, n, dtype=torch.float16)
    p = K.best_matmul(m, n, k) if split == "best" else K.matmul(m, n, k, split=split)
    bufs = device_buffers(p, a=a, b=b)
    card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), (a.float() @ b.float()).half(), **MM_TOL)


def test_softmax(card):
    x = torch.randn(512, 1000, dtype=torch.float16) * 4
    for spill in (False, True):
        p = K.softmax(512, 1000, cores=8, spill=spill)
        bufs = device_buffers(p, x=x)
        card.run(p, bufs)
        torch.testing.assert_close(
            host_value(p, bufs), torch.softmax(x.float(), -1).half(), **MM_TOL
        )


def test_rmsnorm_and_layernorm(card):
    x = torch.randn(100, 4096, dtype=torch.float16)
    w, b = torch.randn(4096, dtype=torch.float16), torch.randn(4096, dtype=torch.float16)
    p = K.rmsnorm(100, 4096, eps=1e-6, cores=8)
    bufs = device_buffers(p, x=x, w=w)
    card.run(p, bufs)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(host_value(p, bufs), ref.half(), **MM_TOL)
    p = K.layernorm(100, 4096, cores=32)
    bufs = device_buffers(p, x=x, w=w, b=b)
    card.run(p, bufs)
    ref = torch.nn.functional.layer_norm(xf, (4096,), w.float(), b.float(), 1e-5)
    torch.testing.assert_close(host_value(p, bufs), ref.half(), **MM_TOL)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_ring_allreduce(card, op):
    x = torch.randn(8, 1000)
    p = K.ring_allreduce(8, 1000, op=op, tile=256)
    bufs = device_buffers(p, x=x)
    card.run(p, bufs)
    ref = x.sum(0) if op == "sum" else x.amax(0)
    torch.testing.assert_close(host_value(p, bufs), ref)


def test_operand_with_non_default_stick_dim():
    """Loads and stores go through each operand's own layout."""
    x = torch.randn(96, 80, dtype=torch.float16)
    lay_in = SpyreTensorLayout.with_stick_dim((96, 80), torch.float16, 0)
    lay_out = SpyreTensorLayout.default((96, 80), torch.float16)
    p = Program(
        "scale",
        (Dim("i", 96, 4, 8), Dim("j", 80)),
        (Operand("x", lay_in), Operand("out", lay_out, "output")),
        (Buffer("t", ("i", "j"), torch.float16, True),),
        (
            Load("t", "x", ("i", "j"), ("i",)),
            Vector("mul_scalar", "t", ("t",), (0.5,), ("i",)),
            Store("out", "t", ("i", "j"), ("i",)),
        ),
        ("i",),
    )
    bufs = device_buffers(p, x=x)
    execute(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), x * 0.5)


def test_buffer_shape_mismatch_is_reported():
    p = K.elementwise("add", (10, 10))
    bufs = device_buffers(p)
    bufs["in0"] = torch.zeros(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="operand 'in0' needs"):
        execute(p, bufs)


def test_elementwise_broadcast_and_mixed_dtypes(card):
    x = torch.randn(33, 130, dtype=torch.float16)
    bias = torch.randn(130, dtype=torch.float16)
    col = torch.randn(33, 1, dtype=torch.float32)
    p = K.elementwise("add", (33, 130), input_shapes=[(33, 130), (130,)])
    bufs = device_buffers(p, in0=x, in1=bias)
    card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), x + bias)
    p = K.elementwise(
        "mul",
        (33, 130),
        input_shapes=[(33, 130), (33, 1)],
        input_dtypes=[torch.float16, torch.float32],
    )
    bufs = device_buffers(p, in0=x, in1=col)
    card.run(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), (x.float() * col).half())


def test_program_from_json_runs_the_same(card):
    p = K.softmax(64, 300, cores=4)
    q = Program.from_json(p.to_json())
    x = torch.randn(64, 300, dtype=torch.float16)
    a, b = device_buffers(p, x=x), device_buffers(q, x=x)
    assert card.run(p, a) == card.run(q, b)
    assert torch.equal(a["out"], b["out"])


def test_elementwise_operands_with_different_layouts_of_one_device_size():
    """Same device size, different stick dims: elements must still pair up by host index."""
    x = torch.randn(64, 64, dtype=torch.float16)
    y = torch.randn(64, 64, dtype=torch.float16)
    lay_a = SpyreTensorLayout.default((64, 64), torch.float16)
    lay_b = SpyreTensorLayout.with_stick_dim((64, 64), torch.float16, 0)
    assert lay_a.device_size == lay_b.device_size and lay_a.dim_map != lay_b.dim_map
    idx = ("i", "j")
    p = Program(
        "add_mixed_layouts",
        (Dim("i", 64), Dim("j", 64)),
        (Operand("x", lay_a), Operand("y", lay_b), Operand("out", lay_a, "output")),
        (
            Buffer("x_t", idx, torch.float16, True),
            Buffer("y_t", idx, torch.float16, True),
            Buffer("o_t", idx, torch.float16, True),
        ),
        (
            Load("x_t", "x", idx, ("i",)),
            Load("y_t", "y", idx, ("i",)),
            Vector("add", "o_t", ("x_t", "y_t"), (), ("i",)),
            Store("out", "o_t", idx, ("i",)),
        ),
        ("i",),
    )
    bufs = device_buffers(p, x=x, y=y)
    execute(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), x + y)
