"""Matmuls that read their weight in place, in its stick layout (sim/direct.py,
csrc/card/gemm.cpp).

The kernel sums fp16 / bf16 / fp32 / DL16 products into fp32 accumulators in a fixed
order: against a float64 reference it is within fp32 rounding, its SIMD and
scalar paths give the same bits, and so do one and two threads.  Through the
device: linear layers of one and many rows (the kernel, and the host-GEMM
path) match the CPU to fp16 rounding, k splits over cores give the same
partial sums, no host copy of a weight is kept, and a write to a weight is
seen by the next read (there is no copy to go stale).
"""

import pytest
import torch

from torch_spyre import _card, dl16
from torch_spyre.sim import direct
from torch_spyre.sim.hostviews import VIEWS


def _values(w):
    """A weight's values: DL16 bits (int16) decoded, else as they are."""
    return dl16.decode(w) if w.dtype == torch.int16 else w


def _reference(a, w3, k, chunk, parts):
    w = _values(w3).reshape(w3.shape[0], -1)[:, :k].double()
    a = a[:, :k].double()
    out = torch.zeros(parts, a.shape[0], w.shape[0], dtype=torch.float64)
    for p in range(parts):
        lo, hi = p * chunk, min(k, (p + 1) * chunk)
        if hi > lo:
            out[p] = a[:, lo:hi] @ w[:, lo:hi].T
    return out


def _stick_weight(n, k, dtype, stick):
    """A [n, k] weight as the device holds it ([k / stick, n, stick]), viewed
    back in host order: [n, k / stick, stick], strided."""
    kb = -(-k // stick)
    if dtype == "dl16":  # the card's format: the bits, zeros of both signs among them
        dev = dl16.encode(torch.randn(kb, n, stick))
        dev.view(-1)[::7] = 0
        dev.view(-1)[3::11] = -(1 << 15)
    else:
        dev = torch.randn(kb, n, stick).to(dtype)
    return dev.permute(1, 0, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, "dl16"])
@pytest.mark.parametrize(
    "m,n,k,chunk,parts",
    [
        (1, 64, 576, 576, 1),  # a decode GEMV
        (1, 30, 576, 128, 5),  # k over 5 cores, the last chunk short
        (3, 7, 100, 100, 1),  # k not whole sticks, n not whole blocks
        (5, 9, 70, 20, 4),  # chunks inside sticks; rows past a block
        (2, 5, 40, 16, 4),  # more cores than chunks with data: a zero part
    ],
)
def test_kernel_matches_float64_and_its_scalar_path(dtype, m, n, k, chunk, parts):
    torch.manual_seed(0)
    stick = 32 if dtype == torch.float32 else 64
    w = _stick_weight(n, k, dtype, stick)
    a = torch.randn(m, k + 3)[:, :k]  # a row stride other than k
    got = _card.stick_gemm(a, w, k, chunk, parts)
    assert got.shape == (parts, m, n) and got.dtype == torch.float32
    ref = _reference(a, w, k, chunk, parts)
    # fp32 accumulation of k products: error ~ k * 2^-24 * sum |a w|
    bound = k * 2.0**-24 * (a.abs().double() @ _values(w).reshape(n, -1)[:, :k].abs().double().T)
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()
    assert torch.equal(got, _card.stick_gemm(a, w, k, chunk, parts, simd=False))


def test_kernel_bits_do_not_depend_on_threads():
    torch.manual_seed(1)
    w = _stick_weight(520, 576, torch.float16, 64)
    a = torch.randn(3, 576)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _card.stick_gemm(a, w, 576, 192, 3)
        torch.set_num_threads(2)
        two = _card.stick_gemm(a, w, 576, 192, 3)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)


def test_kernel_rejects_bad_operands():
    w = _stick_weight(8, 64, torch.float16, 64)
    with pytest.raises(RuntimeError, match="fp32"):
        _card.stick_gemm(torch.randn(2, 64).half(), w, 64, 64, 1)
    with pytest.raises(RuntimeError, match="k exceeds"):
        _card.stick_gemm(torch.randn(2, 64), w, 65, 65, 1)
    with pytest.raises(RuntimeError, match="fp16, bf16, fp32 or int16"):
        _card.stick_gemm(torch.randn(2, 64), w.to(torch.float64), 64, 64, 1)


@pytest.fixture
def plans(monkeypatch):
    """The direct plans of the programs whose runners are built in the test."""
    seen = []
    real = direct.plan

    def spy(program):
        p = real(program)
        seen.extend(p.values())
        return p

    monkeypatch.setattr(direct, "plan", spy)
    from torch_spyre.sim import executor

    executor._runners.clear()
    return seen


# 1 and 3 rows: the kernel; GEMV_ROWS + 1: the host GEMM on the re-laid weight
@pytest.mark.parametrize("rows", [1, 3, direct.GEMV_ROWS + 1])
def test_linear_reads_the_weight_in_place(rows, plans):
    torch.manual_seed(2)
    x = torch.randn(rows, 576).half()
    w = (torch.randn(1536, 576) * 0.05).half()
    got = torch.nn.functional.linear(x.to("spyre"), w.to("spyre")).cpu()
    assert plans, "the linear did not read its weight in place"
    # fp32 sums rounded once to fp16: at most one fp16 rounding apart from the CPU's
    want = torch.nn.functional.linear(x.float(), w.float()).half()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


DL16_LINEAR = r"""
import json, torch, torch_spyre
from torch_spyre import dl16
from torch_spyre.sim import direct, executor
seen = []
real = direct.plan
direct.plan = lambda p: (lambda r: (seen.extend(r.values()), r)[1])(real(p))
executor._runners.clear()
torch.manual_seed(2)
out = {}
for rows in (1, direct.GEMV_ROWS + 1):  # the kernel, and the host GEMM on the decoded weight
    x = torch.randn(rows, 576).half()
    w = (torch.randn(1536, 576) * 0.05).half()
    got = torch.nn.functional.linear(x.to("spyre"), w.to("spyre")).cpu().float()
    xr, wr = dl16.round_trip(x.float()), dl16.round_trip(w.float())
    want = dl16.round_trip(torch.nn.functional.linear(xr, wr))
    out[rows] = float(((got - want).abs() / (want.abs() + 1e-3)).max())
print(json.dumps({"err": out, "dl16_plans": sum(p.dl16 for p in seen)}))
"""


def test_a_dl16_card_reads_its_weights_in_place(spyre_python):
    """On a DL16 card (TORCH_SPYRE_FP16_FORMAT=dl16, IBM's clients) the kernel
    decodes the weight's DL16 bits as it reads them: the same values as the
    decoded weight to fp32 rounding, so results are one DL16 rounding apart
    at most."""
    import json

    proc = spyre_python(DL16_LINEAR, TORCH_SPYRE_FP16_FORMAT="dl16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["dl16_plans"] >= 2
    assert max(res["err"].values()) <= 2.0**-9, res


def test_k_split_partial_sums_match_the_einsum_path(plans):
    """A decode GEMV the planner splits over k: the kernel's per-core partial
    sums, reduced on the ring, equal the einsum path's to fp32 rounding."""
    torch.manual_seed(3)
    # k = 1536 over 3 cores (a 1536 -> 576 projection; 576 -> 1536 is split
    # over n alone since a core's activation tile is loaded once)
    x = torch.randn(1, 1536).half().to("spyre")
    w = (torch.randn(576, 1536) * 0.05).half().to("spyre")
    got = torch.nn.functional.linear(x, w).cpu()
    assert any(p.parts > 1 for p in plans), [p.parts for p in plans]
    prev = direct.set_enabled(False)
    try:
        ref = torch.nn.functional.linear(x, w).cpu()
    finally:
        direct.set_enabled(prev)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_no_host_copy_of_a_weight_is_kept():
    torch.manual_seed(4)
    lin = torch.nn.Linear(512, 1024, bias=False).half().to("spyre")
    x = torch.randn(1, 512).half().to("spyre")
    before = VIEWS.stats()
    for _ in range(6):
        lin(x)
    after = VIEWS.stats()
    assert after["entries"] == before["entries"] and after["bytes"] == before["bytes"]


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.add_(1),
        lambda t: t.copy_(torch.linspace(-1, 1, t.numel()).view(t.shape)),
        lambda t: t[3:9].fill_(1.5),
        lambda t: t.index_put_((torch.tensor([4]).to(t.device),), torch.tensor(3.0).half()),
    ],
)
def test_a_write_to_the_weight_is_seen(write):
    torch.manual_seed(5)
    w = (torch.randn(256, 512) * 0.05).half()
    x = torch.randn(2, 512).half()
    dw, dx = w.to("spyre"), x.to("spyre")
    for _ in range(3):
        dx @ dw.T
    write(w)
    write(dw)
    want = (x.float() @ w.float().T).half()
    torch.testing.assert_close((dx @ dw.T).cpu(), want, rtol=2e-3, atol=2e-3)


def test_merged_weight_halves_are_read_in_place(plans):
    """The two row halves of vLLM's merged gate/up weight, read by one MLP
    program through row offsets."""
    torch.manual_seed(6)
    x = torch.randn(1, 256).half()
    wgu = (torch.randn(1024, 256) * 0.05).half()
    wd = (torch.randn(256, 512) * 0.05).half()
    d = wgu.to("spyre")
    got = torch.ops.spyre.swiglu_mlp(x.to("spyre"), d[:512], d[512:], wd.to("spyre")).cpu()
    h = torch.nn.functional.silu(x.float() @ wgu[:512].float().T) * (
        x.float() @ wgu[512:].float().T
    )
    want = (h.half().float() @ wd.float().T).half()
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
    assert len(plans) >= 3  # gate, up and down


def test_a_contraction_of_one_element():
    """k = 1 (an outer product, as a hybrid model's mm [160, 1] @ [1, 5]): the
    other operand's one column may have any stride."""
    torch.manual_seed(7)
    a = torch.randn(1, 160).half()
    b = torch.randn(1, 5).half()
    got = (a.to("spyre").t() @ b.to("spyre")).cpu()
    torch.testing.assert_close(got, (a.float().t() @ b.float()).half(), rtol=1e-3, atol=1e-3)
    column = torch.randn(1, 5).t()  # [5, 1] with column stride 5
    assert _card.stick_gemm(column, _stick_weight(3, 1, torch.float16, 64), 1, 1, 1).shape == (
        1,
        5,
        3,
    )
