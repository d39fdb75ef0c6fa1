"""Graph rewrites and plan choices a decoder layer's small ops rely on.

* the rotary cos/sin lookups of every layer (same table, same positions) are
  one device gather each, not one per layer;
* ``F.pad`` of the last dim (DeepSeek pads its value heads to the query head
  size) is a lane placement on the PE array, not a masked load;
* an interleaved (GPT-J) rotation written as ``x * cos + (x @ P) * sin``
  compiles and equals the CPU;
* a decode projection whose K and N are 9 sticks (576) is split over 9 x 3
  cores, not over the 5 x 3 that powers of two leave busy;
* a cat too wide for a lane placement (a chunked LM head's logits) of pieces
  whole sticks wide is a stick move.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_spyre.kernels.splits import stick_splits
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import tolerances

H = torch.float16


def _compiled(fn, args):
    """(output, kernels of a profiled second call) of ``fn`` compiled on
    spyre copies of ``args``; nothing may fall back to the host."""
    torch._dynamo.reset()
    dev = [a.to("spyre") for a in args]
    cf = torch.compile(fn, fullgraph=True, dynamic=False)
    dispatch_stats.reset("fallback")
    cf(*dev)
    with profile() as prof:
        out = cf(*dev)
    assert dispatch_stats.counts("fallback") == {} and prof.fallbacks == {}
    return out, prof.kernels


def _rope_layers(x, w1, w2, pos, cos_t, sin_t):
    """Two layers' projections, each rotated by its own lookups of the tables."""
    outs = []
    for w in (w1, w2):
        q = F.linear(x, w).view(x.shape[0], -1, 64)
        cos, sin = F.embedding(pos, cos_t)[:, None], F.embedding(pos, sin_t)[:, None]
        outs.append(q * cos + torch.cat([-q[..., 32:], q[..., :32]], -1) * sin)
    return outs


def test_layers_share_one_lookup_of_each_rotary_table():
    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(16, 64, generator=g).to(H),
        (torch.randn(128, 64, generator=g) / 8).to(H),
        (torch.randn(128, 64, generator=g) / 8).to(H),
        torch.randint(0, 64, (16,), generator=g),
        torch.rand(64, 64, generator=g).to(H),
        torch.rand(64, 64, generator=g).to(H),
    ]
    out, kernels = _compiled(_rope_layers, args)
    want = _rope_layers(*[a.double() if a.is_floating_point() else a for a in args])
    for o, w in zip(out, want):
        torch.testing.assert_close(o.cpu(), w.to(H), **tolerances(H))
    names = [k.name for k in kernels]
    assert sum(n.startswith("index_select") for n in names) == 2, names


@pytest.mark.parametrize("pad,value", [((0, 64), 0.0), ((64, 0), 0.0), ((0, 64), 1.5)], ids=str)
def test_pad_of_the_stick_dim_is_planned(pad, value):
    def fn(x, w):
        v = F.linear(x, w).view(8, 2, 64)  # two heads of 64
        return F.pad(v, pad, value=value) * 2

    g = torch.Generator().manual_seed(1)
    args = [torch.randn(8, 64, generator=g).to(H), (torch.randn(128, 64, generator=g) / 8).to(H)]
    out, _ = _compiled(fn, args)
    torch.testing.assert_close(out.cpu(), fn(*[a.double() for a in args]).to(H), **tolerances(H))


def _interleaved(x, cos, sin, perm):
    return x * cos + torch.matmul(x, perm) * sin


def test_interleaved_rotation_as_a_permutation_matmul_compiles():
    """vllm_plugin/layers.py's GPT-J form: lanes (2j, 2j + 1) rotate together."""
    g = torch.Generator().manual_seed(2)
    hd, j = 64, torch.arange(32)
    perm = torch.zeros(hd, hd)
    perm[2 * j + 1, 2 * j], perm[2 * j, 2 * j + 1] = -1.0, 1.0
    ang = torch.rand(16, 32, generator=g) * 6
    cos = ang.cos().repeat_interleave(2, -1)[:, None]
    sin = ang.sin().repeat_interleave(2, -1)[:, None]
    x = torch.randn(16, 4, hd, generator=g)
    args = [t.to(H) for t in (x, cos, sin, perm)]
    out, _ = _compiled(_interleaved, args)
    x1, x2 = x[..., ::2], x[..., 1::2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    want = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
    torch.testing.assert_close(out.cpu(), want.to(H), **tolerances(H))


def test_stick_counts_split_evenly_over_their_divisors():
    assert stick_splits(9, 32) == [1, 2, 3, 4, 8, 9]
    assert stick_splits(24, 32) == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert stick_splits(64, 32) == [1, 2, 4, 8, 16, 32]
    assert stick_splits(24, 8) == [1, 2, 3, 4, 6, 8]


def test_a_576_projection_streams_on_27_cores():
    """16 x 576 x 576 (SmolLM2's o_proj at batch 16): 9 column sticks over 9
    cores and 9 k sticks over 3, every core an equal share of the weight."""
    g = torch.Generator().manual_seed(3)
    args = [
        torch.randn(16, 576, generator=g).to(H),
        (torch.randn(576, 576, generator=g) / 24).to(H),
    ]
    out, kernels = _compiled(F.linear, args)
    torch.testing.assert_close(
        out.cpu(), F.linear(*[a.double() for a in args]).to(H), **tolerances(H)
    )
    assert len(kernels) == 1 and kernels[0].cores_used == 27


def _chunked_head(x, w1, w2):
    """A chunked LM head (models/patches.py ChunkedLinear): the logits of two
    vocabulary chunks joined along the stick dim."""
    return torch.cat([F.linear(x, w1), F.linear(x, w2)], -1)


def test_cat_of_whole_sticks_is_a_stick_move_not_a_lane_placement():
    """Pieces whole sticks wide (16000 fp16 columns each: 250 sticks) are joined
    by the device's DMA cat (spyre::cat): the lane placement of narrow
    cats would need a [16000, 32000] table per piece, and without either
    Inductor's masked cat does not plan."""
    g = torch.Generator().manual_seed(3)
    args = [
        torch.randn(2, 64, generator=g).to(H),
        (torch.randn(16000, 64, generator=g) / 8).to(H),
        (torch.randn(16000, 64, generator=g) / 8).to(H),
    ]
    out, kernels = _compiled(_chunked_head, args)
    want = _chunked_head(*[a.float() for a in args]).to(H)
    torch.testing.assert_close(out.cpu(), want, **tolerances(H))
    assert any("cat" in k.name for k in kernels), [k.name for k in kernels]
    assert not any("lane" in k.name for k in kernels)
