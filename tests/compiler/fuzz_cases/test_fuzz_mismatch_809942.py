"""Found by the fuzzer (torch_spyre.tools.fuzz), minimised: mismatch.

3 ops (view, norm, norm)
output 0 torch.float32(1, 2, 8): max abs error 0.468 > atol 2.32e-05 (error scale 1.43e-06, max |value| 2.28)

Fixed: a reduction's buffer Inductor tracked to no FX node was taken for
another op of its shape (the norm's rsqrt, the iota of a mask).  A guessed
node must now be a reduction of the buffer's kind and read every graph input
the buffer's loops read (``eager_nodes.origin_node``); a buffer with no such
node (a sum inside a variance's lowering) runs on the host from its IR.
"""

import torch
import torch.nn.functional as F


def make_inputs(device):
    g = torch.Generator().manual_seed(809942)
    v0 = (
        torch.rand(
            (
                1,
                2,
                8,
            ),
            generator=g,
        )
        * 4.0
        + -2.0
    ).to(device)
    v2 = (torch.rand((8,), generator=g) * 1.0 + 0.5).to(device)
    v4 = (torch.rand((8,), generator=g) * 1.0 + 0.5).to(device)
    v5 = (torch.rand((8,), generator=g) * 1.0 + -0.5).to(device)
    return [v0, v2, v4, v5]


def fn(v0, v2, v4, v5):
    v1 = v0.flip([1])
    v3 = F.rms_norm(v1, (8,), v2, 1e-6)
    v6 = F.layer_norm(v3, (8,), v4, v5, 1e-5)
    return (v6,)


#: per output: the oracle's tolerance (torch_spyre/tools/fuzz/oracle.py), frozen
ATOL = [2.32e-05]


def test_case():
    torch._dynamo.reset()
    want = fn(*make_inputs("cpu"))
    eager = fn(*make_inputs("spyre"))
    got = torch.compile(fn, fullgraph=True, dynamic=False)(*make_inputs("spyre"))
    for w, e, g, atol in zip(want, eager, got, ATOL):
        torch.testing.assert_close(e.cpu(), w, rtol=0, atol=atol)
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=atol)
