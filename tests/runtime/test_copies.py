"""Host<->device and device<->device copies through the stick layout."""

import pytest
import torch

import torch_spyre

SHAPES = [(), (0,), (5,), (3, 70), (2, 3, 130), (0, 4), (2, 0, 3), (4, 64), (1, 1, 1, 65)]


def _sample(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 50
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return x.abs().to(dtype)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", torch_spyre.SUPPORTED_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_every_dtype(dtype, shape):
    x = _sample(shape, dtype)
    y = x.to("spyre")
    assert y.device.type == "spyre" and y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.cpu(), x)


def test_int64_is_exact():
    x = torch.tensor([-(2**62), 2**62 + 12345, -1, 0], dtype=torch.int64)
    assert torch.equal(x.to("spyre").cpu(), x)


def test_storage_is_in_stick_layout():
    x = torch.arange(2 * 70, dtype=torch.float16).view(2, 70)
    y = x.to("spyre")
    from torch_spyre.runtime.access import device_tensor

    dev = device_tensor(y)
    assert tuple(dev.shape) == (2, 2, 64)  # [ceil(70/64), 2, 64]
    assert torch.equal(dev[1, 0, :6], x[0, 64:70])  # second stick of row 0
    assert dev[1, 0, 6:].abs().sum() == 0  # padding


def test_non_contiguous_views_read_and_write():
    x = torch.randn(4, 6, 130)
    y = x.to("spyre")
    v = y[1:3, ::2, 10:100]
    assert not v.is_contiguous()
    torch.testing.assert_close(v.cpu(), x[1:3, ::2, 10:100], rtol=0, atol=0)
    v.copy_(torch.full(v.shape, 7.0))
    x[1:3, ::2, 10:100] = 7.0
    assert torch.equal(y.cpu(), x)
    y.transpose(0, 2)[5].copy_(torch.zeros(6, 4))
    x.transpose(0, 2)[5].zero_()
    assert torch.equal(y.cpu(), x)


def test_small_view_of_large_tensor_gathers():
    x = torch.randn(256, 300)
    y = x.to("spyre")
    assert torch.equal(y[17, 3:9].cpu(), x[17, 3:9])
    assert torch.equal(y[:, 299].cpu(), x[:, 299])


def test_views_share_storage_and_layout():
    y = torch.zeros(8, 100, device="spyre")
    v = y[2:4]
    assert v.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert v.device_tensor_layout() == y.device_tensor_layout()
    v.copy_(torch.ones(2, 100))
    assert y.cpu()[2:4].sum() == 200 and y.cpu().sum() == 200


def test_broadcasting_copy():
    z = torch.empty(3, 4, device="spyre")
    z.copy_(torch.arange(4.0))
    assert torch.equal(z.cpu(), torch.arange(4.0).expand(3, 4))
    z.copy_(torch.tensor(2.5).to("spyre"))
    assert torch.equal(z.cpu(), torch.full((3, 4), 2.5))


def test_copy_shape_mismatch_is_clear():
    z = torch.empty(3, 4, device="spyre")
    with pytest.raises(RuntimeError, match=r"\[5\].*\[3, 4\]"):
        z.copy_(torch.ones(5))


def test_device_to_device_and_casts():
    x = torch.randn(5, 77)
    y = x.to("spyre")
    assert torch.equal(y.clone().cpu(), x)
    assert torch.equal(y.half().cpu(), x.half())
    assert torch.equal(y.to(torch.bfloat16).cpu(), x.to(torch.bfloat16))
    assert torch.equal(y.to(torch.int32).cpu(), x.to(torch.int32))
    h = torch.empty(5, 77, dtype=torch.float16, device="spyre")
    h.copy_(y)
    assert torch.equal(h.cpu(), x.half())


def test_copy_into_cpu_view():
    x = torch.randn(4, 4)
    out = torch.zeros(4, 8)
    out[:, ::2].copy_(x.to("spyre"))
    assert torch.equal(out[:, ::2], x)


def test_dtype_reinterpreting_view():
    x = torch.arange(8, dtype=torch.float32)
    y = x.to("spyre")
    assert torch.equal(y.view(torch.int32).cpu(), x.view(torch.int32))
    assert torch.equal(y.view(torch.uint8).cpu(), x.view(torch.uint8))
    y.view(torch.int32)[2].fill_(0)
    x.view(torch.int32)[2] = 0
    assert torch.equal(y.cpu(), x)


def test_channels_last():
    x = torch.arange(120.0).view(2, 3, 4, 5)
    q = torch.empty(2, 3, 4, 5, device="spyre").to(memory_format=torch.channels_last)
    assert q.is_contiguous(memory_format=torch.channels_last)
    q.copy_(x)
    assert torch.equal(q.cpu(), x)
    assert torch.equal(x.to("spyre", memory_format=torch.channels_last).cpu(), x)


def test_empty_strided_arbitrary_strides():
    t = torch.empty_strided((3, 4), (1, 3), device="spyre")
    t.copy_(torch.arange(12.0).view(3, 4))
    assert torch.equal(t.cpu(), torch.arange(12.0).view(3, 4))


def test_resize_keeps_contents():
    y = torch.arange(10.0).to("spyre")
    y.resize_(4)
    assert torch.equal(y.cpu(), torch.arange(4.0))
    y.resize_(1000)
    assert y.shape == (1000,)
    assert torch.equal(y.cpu()[:10], torch.arange(10.0))
    z = torch.arange(6.0).view(2, 3).to("spyre")
    z.resize_(4, 5)
    assert torch.equal(z.cpu().view(-1)[:6], torch.arange(6.0))


def test_item_and_scalars():
    y = torch.tensor(3.25).to("spyre")
    assert y.item() == 3.25
    assert torch.tensor([1, 2, 3]).to("spyre")[1].item() == 2


def test_transfers_are_modelled():
    from torch_spyre.runtime import cards

    before = cards.card(0).stats()
    t0 = torch.spyre.modelled_time_s()
    x = torch.randn(1024, 1024).to("spyre")
    x.cpu()
    after = cards.card(0).stats()
    assert torch.spyre.modelled_time_s() > t0
    assert after != before
