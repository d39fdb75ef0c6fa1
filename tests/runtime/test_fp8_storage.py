"""8-bit floats in device memory: sticks of 128, bit-exact copies, clear errors."""

from __future__ import annotations

import pytest
import torch

import torch_spyre
from torch_spyre.ops.errors import Fp8ArithmeticError

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_every_bit_pattern_round_trips(dtype):
    # all 256 codes (NaNs, infinities of e5m2, subnormals, -0) in a shape that
    # pads its last stick: whole sticks of 128 elements
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).repeat(3)[:700]
    host = codes.view(dtype).reshape(7, 100)
    dev = host.to("spyre")
    assert dev.dtype == dtype
    lay = dev.device_tensor_layout()
    assert lay.device_size == (1, 7, 128) and lay.elems_per_stick() == 128
    assert torch.equal(_bits(dev), codes.reshape(7, 100))
    # views: a strided slice, a transpose made contiguous on the card, a cat
    assert torch.equal(_bits(dev[:, 3:90:2]), _bits(host[:, 3:90:2]))
    assert torch.equal(_bits(dev.t().contiguous()), _bits(host.t().contiguous()))
    assert torch.equal(_bits(torch.cat([dev, dev[:2]])), _bits(torch.cat([host, host[:2]])))
    # device to device, and into part of another device tensor
    other = torch.zeros(7, 100, dtype=dtype, device="spyre")
    other[2:5].copy_(dev[2:5])
    want = torch.zeros(7, 100, dtype=dtype)
    want[2:5] = host[2:5]
    assert torch.equal(_bits(other), _bits(want))


def test_device_formats_and_memory_are_the_cards():
    x = torch.zeros(1000, 1000, dtype=torch.float8_e4m3fn, device="spyre")
    from torch_spyre import _C

    assert str(x.device_tensor_layout().device_dtype) == "DataFormats.SEN143_FP8"
    assert str(_C.get_device_dtype(torch.float8_e5m2)) == "DataFormats.SEN152_FP8"
    assert torch.spyre.get_elem_in_stick(torch.float8_e4m3fn) == 128
    # half the bytes of fp16: 8 sticks per 1000-element row, 1000 rows
    assert x.untyped_storage().nbytes() == 1000 * 1000
    assert torch_spyre.SpyreTensorLayout.default((1000, 1000), x.dtype).nbytes == 8 * 128 * 1000


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_conversions_on_the_card_match_the_cpu(dtype):
    torch.manual_seed(0)
    x = torch.randn(9, 130, dtype=torch.float16) * 40
    q = x.to("spyre").to(dtype)  # the card's conversion (SFU), saturation included
    assert q.device.type == "spyre"
    assert torch.equal(_bits(q), _bits(x.to(dtype)))
    assert torch.equal(q.to(torch.float16).cpu(), x.to(dtype).to(torch.float16))


def test_printing_an_fp8_tensor():
    t = torch.tensor([1.0, -0.5, 448.0]).to(torch.float8_e4m3fn).to("spyre")
    assert "float8_e4m3fn" in repr(t) and "448" in repr(t)


@pytest.mark.parametrize(
    "fn",
    [
        lambda q: q + q,
        lambda q: q * 2,
        lambda q: q.sum(),
        lambda q: q @ q.t(),
        lambda q: torch.softmax(q, -1),
        lambda q: torch.sin(q),
    ],
    ids=["add", "mul_scalar", "sum", "matmul", "softmax", "sin"],
)
def test_arithmetic_on_fp8_names_what_to_do(fn):
    q = torch.randn(4, 64).to(torch.float8_e4m3fn).to("spyre")
    with pytest.raises(Fp8ArithmeticError) as err:
        fn(q)
    msg = str(err.value)
    assert "float8_e4m3fn" in msg and "dequantize" in msg.lower()
    assert "x.to(torch.float16)" in msg
