"""IBM's 2026 layouts in our one SpyreTensorLayout: explicit padding, folding,
sparse sticks and stride maps of non-contiguous tensors; copies both ways,
and the modelled transfers they cost."""

import pytest
import torch

import torch_spyre  # noqa: F401
from torch_spyre import compat
from torch_spyre.runtime import access, cards

F16 = torch.float16
SEN169 = compat.DataFormats.SEN169_FP16
Layout = compat.SpyreTensorLayout


def _h2d_bytes(fn):
    before = cards.card(0).stats()["transfer_bytes"]["h2d"]
    out = fn()
    return out, cards.card(0).stats()["transfer_bytes"]["h2d"] - before


def test_folded_layout_packs_rows_across_sticks():
    x = torch.rand(40, 60, dtype=F16)
    folded = Layout(device_size=[38, 64], stride_map=[64, 1], device_dtype=SEN169)
    dev, folded_bytes = _h2d_bytes(lambda: x.to(device_layout=folded))
    assert torch.equal(dev.cpu(), x)  # both ways, exact
    # the storage is the elements in order, 38 sticks: no stick per row
    lay = access.storage_layout(dev)
    assert lay.host_size == (2400,) and lay.device_size == (38, 64)
    assert lay.nbytes == 38 * 128
    padded, padded_bytes = _h2d_bytes(lambda: x.to("spyre"))
    assert access.storage_layout(padded).nbytes == 40 * 128
    assert folded_bytes < padded_bytes


def test_folded_layout_writes_and_views():
    x = torch.rand(40, 60, dtype=F16)
    folded = Layout(device_size=[38, 64], stride_map=[64, 1], device_dtype=SEN169)
    dev = x.to(device_layout=folded)
    dev[3:5].copy_(torch.ones(2, 60, dtype=F16).to("spyre"))
    want = x.clone()
    want[3:5] = 1
    assert torch.equal(dev.cpu(), want)
    assert torch.equal(dev[:, 7].cpu(), want[:, 7])
    assert torch.equal(dev.t().cpu(), want.t())


def test_a_layout_that_fits_nothing_is_a_clear_error():
    lay = Layout(device_size=[2, 64], stride_map=[64, 1], device_dtype=SEN169)
    with pytest.raises(ValueError, match="folded"):
        torch.rand(40, 60, dtype=F16).to(device_layout=lay)


@pytest.mark.parametrize(
    "device_size,stride_map",
    [([1, 512, 64], [3840, 1, 60]), ([1, 512, 64], [64, 60, 1]), ([1, 60, 64], [3840, 1, 60])],
)
def test_explicit_padding_in_any_dim(device_size, stride_map):
    x = torch.rand(40, 60, dtype=F16)
    lay = Layout(device_size=device_size, stride_map=stride_map, device_dtype=SEN169)
    dev = x.to(device_layout=lay)
    assert torch.equal(dev.cpu(), x)
    assert list(access.storage_layout(dev).device_size) == device_size


def test_stride_map_of_a_transposed_tensor():
    x = torch.rand(60, 40, dtype=F16).t()  # [40, 60], strides [1, 40]
    lay = Layout(device_size=[1, 60, 64], stride_map=[64, 40, 1], device_dtype=SEN169)
    dev = x.to(device_layout=lay)
    assert torch.equal(dev.cpu(), x)
    # the stick runs along x's dim 0 (stride 1 in x's memory)
    assert access.storage_layout(dev).dim_map[-1] == 0


def test_sparse_stick_layout_round_trips():
    x = torch.rand(8, 16, dtype=F16)
    lay = Layout([8, 16], [16, 1], F16, [0, 1, -1])
    assert list(lay.device_size) == [16, 1, 8, 64]
    assert list(lay.stride_map) == [1, -1, 16, -1]
    dev, nbytes = _h2d_bytes(lambda: x.to(device_layout=lay))
    assert torch.equal(dev.cpu(), x)
    # one element per stick: every value costs a whole stick
    assert access.storage_layout(dev).nbytes == 8 * 16 * 128
    assert nbytes >= 8 * 16 * 128


def test_a_fold_that_breaks_stick_boundaries_costs_descriptors():
    """Rows of 60 fp16 packed into 64-element sticks: most rows straddle two
    sticks, and the DMA gathers each such stick from two host pieces."""
    from torch_spyre.runtime import access

    x = torch.rand(40, 60, dtype=F16)
    folded = Layout(device_size=[38, 64], stride_map=[64, 1], device_dtype=SEN169)
    dev = x.to(device_layout=folded)
    breaks = access.fold_segments(dev)
    assert 0 < breaks < 40
    card = cards.card(0)
    assert card.transfer_time("h2d", 38 * 128, breaks) > card.transfer_time("h2d", 38 * 128)
    # rows of whole sticks never break one
    y = torch.rand(4, 128, dtype=F16).to(
        device_layout=Layout(device_size=[8, 64], stride_map=[64, 1], device_dtype=SEN169)
    )
    assert access.fold_segments(y) == 0


def test_tiled_layout_with_a_padding_block():
    """[40, 60] as 2 blocks of 24 rows (the block dim outside the rows' dim in
    device order): the storage lays out 48 rows, the tensor is its first 40."""
    x = torch.rand(40, 60, dtype=F16)
    lay = Layout(device_size=[24, 1, 2, 64], stride_map=[60, 64, 1440, 1], device_dtype=SEN169)
    dev = x.to(device_layout=lay)
    assert torch.equal(dev.cpu(), x)
    assert access.storage_layout(dev).host_size == (2, 24, 60)
    dev[30:].copy_(torch.zeros(10, 60, dtype=F16).to("spyre"))
    want = x.clone()
    want[30:] = 0
    assert torch.equal(dev.cpu(), want)


def test_trailing_ones_stick_holds_one_element():
    x = torch.rand(60, dtype=F16)
    lay = Layout(device_size=[1, 60, 64], stride_map=[64, 1, 1], device_dtype=SEN169)
    assert list(lay.stride_map) == [-1, 1, -1]
    dev = x.to(device_layout=lay)
    assert torch.equal(dev.cpu(), x)
    assert access.storage_layout(dev).nbytes == 60 * 128


def test_ibm_model_loader_lays_out_linear_and_embedding_weights():
    from torch_spyre.model_utils import load_model_to_spyre

    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 128, dtype=F16), torch.nn.Linear(128, 128, dtype=F16)
    )
    ref = [p.detach().clone() for p in model.parameters()]
    load_model_to_spyre(model)
    emb, lin = model[0].weight, model[1].weight
    assert list(emb.device_tensor_layout().device_size) == [10, 2, 64]  # rows outermost
    assert lin.device_tensor_layout().dim_map[-1] == 0  # sticks along out_features
    for p, want in zip(model.parameters(), ref):
        assert p.device.type == "spyre" and torch.equal(p.cpu(), want)


def test_eager_ops_and_compiled_graphs_read_a_folded_tensor():
    from torch_spyre.runtime import fallback

    x = torch.rand(40, 60, dtype=F16)
    w = torch.rand(60, 32, dtype=F16)
    folded = Layout(device_size=[38, 64], stride_map=[64, 1], device_dtype=SEN169)
    dev = x.to(device_layout=folded)
    fallback.reset_fallback_counts()
    ref = x.float()
    torch.testing.assert_close((dev + dev).cpu().float(), ref + ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(
        (dev @ w.to("spyre")).cpu().float(), ref @ w.float(), atol=5e-2, rtol=2e-2
    )
    torch.testing.assert_close(dev.sum(-1).cpu().float(), ref.sum(-1), atol=5e-2, rtol=1e-2)
    compiled = torch.compile(lambda a: (a * 2 + 1).relu())
    torch.testing.assert_close(
        compiled(dev).cpu().float(), (ref * 2 + 1).relu(), atol=2e-2, rtol=1e-2
    )
    assert fallback.fallback_counts() == {}  # on the card, not the host


def test_stride_zero_repeats_the_data():
    """IBM's "expanding" layout: a device dim of stride 0 holds copies of the
    data (the card stores each; a copy back reads the first)."""
    x = torch.rand(60, dtype=F16)
    lay = Layout(device_size=[1, 512, 64], stride_map=[64, 0, 1], device_dtype=SEN169)
    assert list(lay.stride_map) == [-1, 0, 1]
    assert list(Layout([], F16).stride_map) == [-1, -1]  # a scalar's stick repeats nothing
    dev = x.to(device_layout=lay)
    assert torch.equal(dev.cpu(), x)
    stored = access.storage_layout(dev)
    assert stored.nbytes == 512 * 128
    raw = access.device_tensor(dev, stored).reshape(512, 64)
    assert torch.equal(raw[0], raw[511])  # every copy written
