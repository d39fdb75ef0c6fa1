"""Row gathers and scatters by device offsets (ops/indexing.py) against the CPU.

Each runs on whole tensors (per-dim offset tables), on views (storage
offsets) and on layouts with padding; the generic path serves the rest
(masks, accumulation), which these tests also cover.
"""

import pytest
import torch

from torch_spyre.ops import indexing
from torch_spyre.runtime import access


def _pair(*shape, dtype=torch.float16):
    x = torch.randn(*shape).to(dtype)
    return x, x.to("spyre")


@pytest.mark.parametrize("shape,dim", [((50, 70), 0), ((50, 70), 1), ((3, 5, 64, 16), 2)])
def test_index_select(shape, dim):
    x, d = _pair(*shape)
    idx = torch.tensor([4, 0, 2, 2])
    torch.testing.assert_close(
        torch.index_select(d, dim, idx.to("spyre")).cpu(), x.index_select(dim, idx), rtol=0, atol=0
    )
    # a view (not its whole base): storage offsets instead of offset tables
    v, dv = x[1:], d[1:]
    torch.testing.assert_close(
        torch.index_select(dv, dim, idx).cpu(), v.index_select(dim, idx), rtol=0, atol=0
    )


def test_index_select_out_of_range_is_an_error():
    _, d = _pair(4, 8)
    with pytest.raises(IndexError, match="out of bounds"):
        torch.index_select(d, 0, torch.tensor([4]).to("spyre"))


def test_embedding_reads_only_its_rows():
    w, dw = _pair(1000, 96)
    ids = torch.tensor([[3, 999, 0], [5, 5, 7]])
    got = torch.nn.functional.embedding(ids.to("spyre"), dw)
    torch.testing.assert_close(got.cpu(), torch.nn.functional.embedding(ids, w), rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 2])
def test_index_copy_inplace(dim):
    x, d = _pair(4, 3, 64, 8)
    idx = torch.tensor([1, 3]) if dim == 0 else torch.tensor([63, 0, 17])
    src_shape = list(x.shape)
    src_shape[dim] = len(idx)
    src = torch.randn(src_shape).half()
    x.index_copy_(dim, idx, src)
    d.index_copy_(dim, idx.to("spyre"), src.to("spyre"))
    assert torch.equal(d.cpu(), x)


def test_index_put_kv_cache_style():
    cache, dcache = _pair(1, 2, 40, 24)  # 24 lanes: a padded stick
    pos = torch.tensor([5, 6])
    new = torch.randn(1, 2, 2, 24).half()
    cache[:, :, pos] = new
    dcache[:, :, pos.to("spyre")] = new.to("spyre")
    assert torch.equal(dcache.cpu(), cache)
    # negative indices wrap, as on the CPU
    cache[torch.tensor([-1])] = 0.5
    dcache[torch.tensor([-1]).to("spyre")] = 0.5
    assert torch.equal(dcache.cpu(), cache)


def test_index_gather_and_generic_cases():
    x, d = _pair(6, 10)
    rows = torch.tensor([5, -1, 0])
    assert torch.equal(d[rows.to("spyre")].cpu(), x[rows])
    mask = x[:, 0] > 0  # a boolean mask: the generic path
    assert torch.equal(d[mask.to("spyre")].cpu(), x[mask])
    acc = torch.zeros(6, 10).half()
    dacc = acc.to("spyre")
    i = torch.tensor([1, 1, 2])
    acc.index_put_((i,), torch.ones(3, 10).half(), accumulate=True)
    dacc.index_put_((i.to("spyre"),), torch.ones(3, 10).half().to("spyre"), accumulate=True)
    assert torch.equal(dacc.cpu(), acc)


def test_indexed_write_invalidates_host_views():
    """A scatter into a weight-like tensor a kernel has read (and whose host view
    the executor keeps) must be seen by the next kernel."""
    w, dw = _pair(256, 512)
    x = torch.randn(4, 512).half()
    dx = x.to("spyre")
    for _ in range(3):  # read enough times to be kept
        dx @ dw.T
    dw.index_copy_(0, torch.tensor([7]).to("spyre"), torch.full((1, 512), 2.0).half().to("spyre"))
    w.index_copy_(0, torch.tensor([7]), torch.full((1, 512), 2.0).half())
    got = (dx @ dw.T).cpu()
    torch.testing.assert_close(got, (x.float() @ w.float().T).half(), rtol=2e-3, atol=2e-3)


def test_fast_paths_are_taken():
    """The offset paths serve these calls (not the whole-tensor generic path)."""
    _, d = _pair(64, 64)
    calls = []
    orig = access.read
    access.read = lambda t: calls.append(tuple(t.shape)) or orig(t)
    try:
        indexing.index_select(d, 0, torch.tensor([1, 2]))
    finally:
        access.read = orig
    assert (64, 64) not in calls


@pytest.mark.parametrize("n_pos", [1, 16])
def test_kv_cache_write_is_modelled_as_its_source_bytes(n_pos):
    """cache[:, :, pos] = new (index_put with whole leading dims): the DMA moves
    the new rows, not the cache (and not the cache once per position)."""
    import torch_spyre.profiler as sprof

    dcache = torch.zeros(1, 8, 256, 128, dtype=torch.float16).to("spyre")
    new = torch.randn(1, 8, n_pos, 128).half().to("spyre")
    pos = torch.arange(n_pos).to("spyre")
    with sprof.profile() as prof:
        dcache[:, :, pos] = new
    (k,) = [k for k in prof.kernels if "index_put" in k.name]
    assert k.name.endswith(f"_{new.numel() * 2}B")
