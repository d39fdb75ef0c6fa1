import pytest
import torch
from sim_helpers import device_buffers

from torch_spyre import kernels as K
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Buffer,
    Dim,
    Load,
    LXOverflowError,
    Operand,
    Program,
    ProgramError,
    SpanError,
    Store,
    Vector,
)
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import SimulatedCard

ALL = [
    K.elementwise("add", (300, 200)),
    K.matmul(256, 384, 512, split=(2, 2, 8)),
    K.softmax(512, 1024, cores=1, spill=True),
    K.rmsnorm(64, 512),
    K.layernorm(64, 512),
    K.ring_allreduce(8, 1000),
    K.gemv(4096, 25600, cores=25),
]


@pytest.mark.parametrize("p", ALL, ids=lambda p: p.name)
def test_json_round_trip_and_dump(p):
    q = Program.from_json(p.to_json())
    assert q == p and q.to_json() == p.to_json()
    text = str(p)
    assert p.name in text and "lx total" in text
    for b in p.buffers:
        assert b.name in text
    p.validate()


def test_lx_overflow_is_rejected_not_run():
    p = K.matmul(1024, 1024, 1024, split=(1, 1, 1), tiles=(1024, 1024, 128))
    with pytest.raises(LXOverflowError) as e:
        p.validate()
    msg = str(e.value)
    assert "acc" in msg and "a_t" in msg and "smaller tiles" in msg and "2 MiB" in msg
    assert isinstance(e.value, ProgramError) and isinstance(e.value, ValueError)
    card = SimulatedCard(0)
    bufs = device_buffers(p, a=torch.ones(1024, 1024, dtype=torch.float16))
    with pytest.raises(LXOverflowError):
        card.run(p, bufs)
    assert not bufs["out"].any()  # nothing ran
    assert card.clock_s == 0 and card.stats()["kernels"] == 0
    # ... and fits a card with a bigger LX (a design study)
    p.validate(HardwareConfig(lx_bytes=16 << 20))


def test_span_limit():
    # 1 core adding three 128 MiB tensors touches 384 MiB > 256 MiB
    p = K.elementwise("add", (8192, 8192), cores=1)
    with pytest.raises(SpanError, match="256 MiB"):
        p.validate()
    K.elementwise("add", (8192, 8192), cores=32).validate()


def test_partial_results_must_be_reduced():
    lay = SpyreTensorLayout.default((8, 64), torch.float32)
    p = Program(
        "bad",
        (Dim("c", 8, 8), Dim("n", 64)),
        (
            Operand("x", lay),
            Operand("out", SpyreTensorLayout.default((64,), torch.float32), "output"),
        ),
        (Buffer("x_t", ("c", "n"), torch.float32), Buffer("r", ("n",), torch.float32)),
        (
            Load("x_t", "x", ("c", "n")),
            __import__("torch_spyre.ir", fromlist=["Reduce"]).Reduce("sum", "r", "x_t", "c"),
            Store("out", "r", ("n",)),
        ),
    )
    with pytest.raises(ProgramError, match="RingAllReduce"):
        p.validate()


def test_other_validation_errors():
    lay = SpyreTensorLayout.default((4, 64), torch.float16)

    def prog(steps, cores_dims=None):
        dims = (Dim("i", 4), Dim("j", 64))
        return Program(
            "t",
            cores_dims or dims,
            (Operand("x", lay), Operand("out", lay, "output")),
            (Buffer("t", ("i", "j")),),
            steps,
        )

    ok = (Load("t", "x", ("i", "j")), Store("out", "t", ("i", "j")))
    prog(ok).validate()
    with pytest.raises(ProgramError, match="unknown vector op 'frobnicate'"):
        prog(ok[:1] + (Vector("frobnicate", "t", ("t",)),) + ok[1:]).validate()
    with pytest.raises(ProgramError, match="has size 4 but dim 'j' has size 64"):
        prog((Load("t", "x", ("j", "i")), ok[1])).validate()
    with pytest.raises(ProgramError, match="never stored"):
        prog(ok[:1]).validate()
    with pytest.raises(ProgramError, match="before any step writes it"):
        prog(ok[1:]).validate()
    with pytest.raises(ProgramError, match="needs 64 cores but the card has 32"):
        prog(ok, cores_dims=(Dim("i", 4, 4), Dim("j", 64, 16))).validate()
