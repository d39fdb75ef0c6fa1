"""Fills of device memory (``access.fill``: ``zero_``, ``fill_``, ``torch.zeros``,
``torch.full`` on the card) against the CPU and against the general path.

A fill of a whole storage writes device memory without reading it; the bytes
must be exactly those the general path (``access.write`` of the values)
stores, padding included, in both fp16 formats; a fill of a view takes the
general path.  The modelled time is the DMA program's either way.
"""

from __future__ import annotations

import pytest
import torch

from torch_spyre import layout as layout_mod
from torch_spyre.runtime import access, fallback

CASES = [
    ((4, 64), torch.float16),  # whole sticks
    ((3, 5), torch.float16),  # padded sticks
    ((2, 3, 70), torch.bfloat16),
    ((7,), torch.float32),
    ((3, 70), torch.int32),
    ((5, 9), torch.bool),
    ((), torch.float16),  # a scalar (stored as a one-element vector)
]
VALUES = [0, 1.5, -0.0, 3, True]


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    return access.device_tensor(t).reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("fp16_format", ["ieee", "dl16"])
@pytest.mark.parametrize("shape,dtype", CASES)
def test_a_fill_stores_what_a_write_stores(shape, dtype, fp16_format, monkeypatch):
    monkeypatch.setattr(layout_mod, "FP16_FORMAT", fp16_format)
    for value in VALUES:
        if dtype == torch.bool and not isinstance(value, bool):
            continue
        filled = torch.randn(shape).to(dtype).to("spyre")
        assert access.fill(filled, value)
        written = torch.randn(shape).to(dtype).to("spyre")
        access.write(written, torch.full(shape, value, dtype=dtype))
        assert torch.equal(_device_bytes(filled), _device_bytes(written)), (value, shape)
        assert torch.equal(filled.cpu(), torch.full(shape, value, dtype=dtype))


@pytest.mark.parametrize("shape,dtype", CASES)
def test_fills_match_the_cpu(shape, dtype):
    x = torch.randn(shape).to(dtype)
    d = x.to("spyre")
    d.zero_()
    assert torch.equal(d.cpu(), torch.zeros_like(x))
    d.fill_(True if dtype == torch.bool else 2.5)
    assert torch.equal(d.cpu(), x.clone().fill_(True if dtype == torch.bool else 2.5))
    z = torch.zeros(shape, dtype=dtype, device="spyre")
    assert torch.equal(z.cpu(), torch.zeros(shape, dtype=dtype))
    f = torch.full(shape, 1, dtype=dtype, device="spyre")
    assert torch.equal(f.cpu(), torch.full(shape, 1, dtype=dtype))


def test_a_fill_of_a_view_keeps_the_rest():
    x = torch.randn(6, 70).half()
    d = x.to("spyre")
    d[2:4].zero_()
    d[:, 5].fill_(-3.0)
    x[2:4] = 0
    x[:, 5] = -3.0
    assert torch.equal(d.cpu(), x)


def test_a_whole_fill_reads_nothing(monkeypatch):
    """``torch.zeros`` of a KV-cache-sized tensor writes device memory once: no
    host round trip of the generic path (``fallback.run_on_values``)."""
    calls = []
    orig = fallback.run_on_values
    monkeypatch.setattr(
        "torch_spyre.ops.movement.run_on_values",
        lambda *a, **k: calls.append(a[0]) or orig(*a, **k),
    )
    z = torch.zeros(2, 64, 16, 3, 64, dtype=torch.float16, device="spyre")
    z.fill_(0.25)
    assert calls == []
    assert bool((z.cpu() == 0.25).all())
    z[0].zero_()  # a view: the generic path
    assert len(calls) == 1


def test_a_fill_is_seen_by_the_next_kernel():
    """The executor's host view of a weight it has read is stale after a fill."""
    w = torch.randn(256, 512).half()
    dw = w.to("spyre")
    dx = torch.randn(4, 512).half().to("spyre")
    for _ in range(3):  # read enough times for the executor to keep a host view
        dx @ dw.T
    dw.zero_()
    assert not bool((dx @ dw.T).cpu().any())


def test_a_fill_is_modelled_as_the_dma_program():
    import torch_spyre.profiler as sprof

    d = torch.empty(64, 64, dtype=torch.float16, device="spyre")
    with sprof.profile() as prof:
        d.zero_()
        d[1:].fill_(1.0)
    names = [k.name for k in prof.kernels]
    assert names == [f"zero__{64 * 64 * 2}B", f"fill__{63 * 64 * 2}B"], names


def test_zeroing_a_large_written_block():
    """A whole block of 2 MiB or more is zeroed by dropping its pages (the
    card's ``zero_range``); written and read first, it must read back zero,
    and the block stays usable."""
    from torch_spyre import _card

    x = torch.randn(2 << 20).half()  # 4 MiB, one row of sticks in order
    d = x.to("spyre")
    assert torch.equal(d.cpu(), x)
    d.zero_()
    assert not bool(d.cpu().any())
    d.copy_(x.to("spyre"))
    assert torch.equal(d.cpu(), x)
    mem = access.device_tensor(d)
    base, nbytes = mem.data_ptr(), mem.numel() * mem.element_size()
    assert _card.zero_range(base + 128, 256)  # inside the block: written zero
    assert torch.equal(d.cpu()[192:], x[192:])
    assert not bool(d.cpu()[64:192].any())
    assert not _card.zero_range(base, nbytes + 128)  # past the block: refused
    assert torch.equal(d.cpu()[192:], x[192:])
