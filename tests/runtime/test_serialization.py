"""torch.save / torch.load, deepcopy, modules moved to the card and back."""

import copy
import io

import torch


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def test_save_load_tensors_and_views():
    x = torch.randn(4, 6, 130)
    y = x.to("spyre")
    v = y[1:3, ::2]
    out = _round_trip({"y": y, "v": v, "h": y.half()})
    assert out["y"].device.type == "spyre"
    assert torch.equal(out["y"].cpu(), x)
    assert torch.equal(out["v"].cpu(), x[1:3, ::2])
    assert torch.equal(out["h"].cpu(), x.half())


def test_loaded_views_still_share_storage():
    y = torch.arange(20.0).to("spyre")
    out = _round_trip([y, y[5:10]])
    out[1].fill_(0)
    assert out[0].cpu()[5:10].sum() == 0


def test_state_dict_round_trip_and_map_location():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(m.state_dict())
    m.to("spyre")
    sd = _round_trip(m.state_dict())
    assert all(t.device.type == "spyre" for t in sd.values())
    for k, t in sd.items():
        assert torch.equal(t.cpu(), ref[k])
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    cpu_sd = torch.load(buf, map_location="cpu")
    for k, t in cpu_sd.items():
        assert t.device.type == "cpu" and torch.equal(t, ref[k])


def test_deepcopy():
    y = torch.randn(3, 70).to("spyre")
    z = copy.deepcopy(y)
    assert z.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert torch.equal(z.cpu(), y.cpu())


def test_module_to_spyre_and_back():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 8)
    ref = m(x)
    m.to("spyre")
    assert all(p.device.type == "spyre" for p in m.parameters())
    out = m(x.to("spyre"))
    assert out.device.type == "spyre"
    torch.testing.assert_close(out.cpu(), ref)
    m.to("cpu")
    torch.testing.assert_close(m(x), ref)


def test_module_to_keeps_parameters_and_tied_weights():
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    m.head = torch.nn.Linear(4, 10, bias=False)
    m.head.weight = m.emb.weight
    param = m.emb.weight
    m.to("spyre")
    assert m.emb.weight is param and m.head.weight is m.emb.weight
    assert param.device.type == "spyre"
    m.half().to("cpu")
    assert m.head.weight is m.emb.weight and param.dtype == torch.float16


def test_loaded_tensor_is_laid_out_once_then_used_in_place():
    """A loaded tensor has a linear storage (bytes in order); the first kernel
    that takes it whole re-lays the storage into its stick layout in place (one
    modelled d2d), later kernels read it where it is; views of the storage
    follow the new layout."""
    from torch_spyre.runtime import access, cards

    torch.manual_seed(0)
    a = torch.randn(64, 128, dtype=torch.float16)
    w = torch.randn(128, 64, dtype=torch.float16)
    dw = _round_trip(w.to("spyre"))
    row = dw[3]  # a view of the same loaded storage
    assert access.is_whole_linear(dw)
    d2d = lambda: cards.card(0).stats()["transfer_bytes"]["d2d"]  # noqa: E731
    x = a.to("spyre")
    before = d2d()
    y1 = x @ dw
    once = d2d() - before
    assert once == 128 * 64 * 2  # the weight's sticks, re-laid once
    assert not access.is_whole_linear(dw)
    y2 = x @ dw
    assert d2d() - before == once  # used in place from then on
    torch.testing.assert_close(y1.cpu(), (a.float() @ w.float()).half(), atol=2e-2, rtol=1e-2)
    assert torch.equal(y1.cpu(), y2.cpu())
    assert torch.equal(row.cpu(), w[3]) and torch.equal(dw.cpu(), w)
