"""Loads of a sub-block of an operand (``Load.offsets``): validated, executed
and timed as the sticks they touch."""

from __future__ import annotations

import pytest
import torch
from sim_helpers import device_buffers, host_value

from torch_spyre.ir import Buffer, Dim, Load, Operand, Program, ProgramError, Store, Vector
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import estimate, execute


def _program(offsets: tuple[int, ...], rows: int = 5, cols: int = 128) -> Program:
    """out[h, r, c] = 2 * x[h, offsets..., c]: rows r of every head h of a
    [3, 64, 128] fp16 buffer (a KV cache's first positions)."""
    x = SpyreTensorLayout.default((3, 64, 128), torch.float16)
    out = SpyreTensorLayout.default((3, rows, cols), torch.float16)
    return Program(
        name="sub_block",
        dims=(Dim("h", 3), Dim("r", rows), Dim("c", cols)),
        operands=(Operand("x", x), Operand("out", out, "output")),
        buffers=(Buffer("t", ("h", "r", "c")), Buffer("u", ("h", "r", "c"))),
        steps=(
            Load("t", "x", ("h", "r", "c"), offsets=offsets),
            Vector("mul_scalar", "u", ("t",), (2.0,)),
            Store("out", "u", ("h", "r", "c")),
        ),
    )


def test_sub_block_load_reads_the_right_elements() -> None:
    x = torch.randn(3, 64, 128, dtype=torch.float16)
    p = _program((0, 7, 0))
    bufs = device_buffers(p, x=x)
    execute(p, bufs)
    torch.testing.assert_close(host_value(p, bufs), x[:, 7:12] * 2)
    # a JSON round trip keeps the offsets
    assert Program.from_json(p.to_json()) == p


def test_sub_block_costs_the_sticks_it_touches() -> None:
    part = _program((0, 7, 0))
    # 3 heads x 5 rows x 128 fp16 lanes read, and as many written: the 59
    # other rows of every head are not moved
    assert estimate(part).dram_bytes == 2 * (3 * 5 * 128 * 2)
    assert estimate(_program((0, 0, 0), rows=64)).dram_bytes == 2 * (3 * 64 * 128 * 2)
    assert "from [0, 7, 0]" in part.dump()


@pytest.mark.parametrize(
    "offsets, match",
    [
        ((0, 60, 0), "runs past it"),  # 60 + 5 > 64
        ((0, 7), "one offset per host dim"),
        ((0, 7, 32), "not whole sticks"),  # a DMA cannot shift lanes
    ],
)
def test_bad_offsets_are_rejected(offsets, match) -> None:
    cols = 96 if offsets[-1] == 32 else 128
    with pytest.raises(ProgramError, match=match):
        _program(offsets, cols=cols).validate()
