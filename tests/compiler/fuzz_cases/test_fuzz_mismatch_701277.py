"""Found by the fuzzer (torch_spyre.tools.fuzz), minimised: mismatch.

9 ops (pad, view, reduce, cast, view, reduce, unary, binary, index)
output 4 torch.float32(12, 3, 17): max abs error 2.64 > atol 1.46e-05 (error scale 8.86e-07, max |value| 3.96)

Fixed: the index_add writes through ``permute`` into the pad's buffer; its
eager node re-ran that view as a reshape of the buffer and stored the result
row-major.  It now copies the base, re-runs the views and writes through them
(``eager_nodes.function_source``).
"""

import torch
import torch.nn.functional as F


def make_inputs(device):
    g = torch.Generator().manual_seed(701277)
    v0 = (
        torch.rand(
            (
                128,
                4,
                2,
            ),
            generator=g,
        )
        * 4.0
        + -2.0
    ).to(device)
    v1 = (
        torch.rand(
            (
                3,
                17,
                7,
            ),
            generator=g,
        )
        * 4.0
        + -2.0
    ).to(device)
    v10 = torch.randint(0, 17, (2,), generator=g).to(device)
    v11 = (
        torch.rand(
            (
                12,
                3,
                2,
            ),
            generator=g,
        )
        * 4.0
        + -2.0
    ).to(device)
    return [v0, v1, v10, v11]


def fn(v0, v1, v10, v11):
    v2 = F.pad(v1, [3, 2], value=0.0)
    v3 = v2.permute(2, 0, 1)
    v4 = v1.argmin(2, keepdim=True)
    v5 = v1.to(torch.float16)
    v6 = v4.transpose(2, 1)
    v7 = torch.logsumexp(v3, [2], keepdim=True)
    v8 = F.hardtanh(v2)
    v9 = v3 * v7
    v12 = v3.index_add(2, v10, v11)
    return (
        v5,
        v6,
        v8,
        v9,
        v12,
    )


#: per output: the oracle's tolerance (torch_spyre/tools/fuzz/oracle.py), frozen
ATOL = [0.0564, 0.0, 1.19e-07, 7.09e-05, 1.46e-05]


def test_case():
    torch._dynamo.reset()
    want = fn(*make_inputs("cpu"))
    eager = fn(*make_inputs("spyre"))
    got = torch.compile(fn, fullgraph=True, dynamic=False)(*make_inputs("spyre"))
    for w, e, g, atol in zip(want, eager, got, ATOL):
        torch.testing.assert_close(e.cpu(), w, rtol=0, atol=atol)
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=atol)
