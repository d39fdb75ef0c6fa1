import pytest
import torch

from torch_spyre import _C
from torch_spyre.layout import SpyreTensorLayout, UnsupportedDtypeError, stick_elems

SHAPES = [
    (),
    (1,),
    (5,),
    (64,),
    (65,),
    (3, 70),
    (512, 240),
    (2, 3, 130),
    (0,),
    (0, 4),
    (2, 0, 3),
    (1, 2, 3, 4),
    (7, 1, 1, 33),
]


def test_hardware_md_examples():
    lay = SpyreTensorLayout.default((512, 240), torch.float16)
    assert lay.device_size == (4, 512, 64)
    assert lay.stride_map == (64, 240, 1)
    scalar = SpyreTensorLayout.default((), torch.float16)
    assert scalar.device_size == (1, 64)


def test_stick_is_128_bytes():
    assert stick_elems(torch.float16) == 64
    assert stick_elems(torch.float32) == 32
    assert stick_elems(torch.int8) == 128
    lay = SpyreTensorLayout.default((3, 70), torch.float32)
    assert lay.nbytes % 128 == 0 and lay.device_size == (3, 3, 32)


def test_three_d_rule():
    lay = SpyreTensorLayout.default((2, 3, 130), torch.float16)
    # [d1, ceil(d2/64), d0, 64]
    assert lay.device_size == (3, 3, 2, 64)
    assert lay.stride_map == (130, 64, 390, 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64, torch.bool])
def test_round_trip_and_offsets(shape, dtype):
    x = (torch.randn(shape) * 10).to(dtype)
    lay = SpyreTensorLayout.default(shape, dtype)
    dev = lay.to_device(x)
    assert tuple(dev.shape) == lay.device_size
    assert torch.equal(lay.to_host(dev), x)
    if lay.numel:
        offs = lay.device_offsets(torch.arange(lay.numel))
        assert torch.equal(dev.reshape(-1)[offs], x.reshape(-1))


@pytest.mark.parametrize("shape", [(3, 70), (2, 3, 130), (4, 5, 6, 7)])
def test_other_stick_dims(shape):
    x = torch.randn(shape)
    for sd in range(len(shape)):
        lay = SpyreTensorLayout.with_stick_dim(shape, torch.float32, sd)
        assert lay.stick_dim == sd
        dev = lay.to_device(x)
        assert torch.equal(lay.to_host(dev), x)


def test_padding_is_zero():
    x = torch.ones(2, 70, dtype=torch.float16)
    dev = SpyreTensorLayout.default((2, 70), torch.float16).to_device(x)
    assert dev.sum().item() == 140  # 2 sticks of padding per row are zero


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8, torch.int64])
def test_cpp_default_layout_matches_python(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="spyre")
    assert t.device_tensor_layout() == SpyreTensorLayout.default(shape, dtype)
    if t.numel():  # the allocator recorded the layout it padded for
        host, device, dim_map, name = _C._layout_of(t)
        ref = SpyreTensorLayout.default(shape, dtype)
        assert (tuple(host), tuple(device), tuple(dim_map)) == (
            ref.host_size,
            ref.device_size,
            ref.dim_map,
        )


def test_unsupported_dtype_names_supported_set():
    with pytest.raises(UnsupportedDtypeError, match="float64.*supported dtypes are"):
        SpyreTensorLayout.default((2,), torch.float64)
