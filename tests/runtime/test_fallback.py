"""The explicit host fallback: counted, warned once, governed by a policy."""

import warnings

import pytest
import torch

import torch_spyre
from torch_spyre.runtime.fallback import (
    SpyreFallbackError,
    SpyreFallbackWarning,
    fallback_policy,
)


@pytest.fixture(autouse=True)
def _fresh_counts():
    torch_spyre.reset_fallback_counts()
    yield
    torch_spyre.reset_fallback_counts()


def _count(op: str) -> int:
    # structured ops fall back through their .out overload
    return sum(n for k, n in torch_spyre.fallback_counts().items() if k.split(".")[0] == op)


def test_counts_and_warns_once_per_op():
    x = torch.randn(4, 4).to("spyre")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fallback_policy("warn"):
            torch.median(x)
            torch.median(x)
            torch.median(x)
    fb = [w for w in caught if issubclass(w.category, SpyreFallbackWarning)]
    assert len(fb) == 1 and "aten.median" in str(fb[0].message)
    assert _count("median") == 3


def test_silent_policy_counts_without_warning():
    x = torch.randn(4).to("spyre")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpyreFallbackWarning)
        with fallback_policy("silent"):
            torch.median(x)
    assert _count("median") == 1


def test_error_policy_names_op_and_shapes():
    x = torch.randn(4, 3).to("spyre")
    with fallback_policy("error"):
        with pytest.raises(
            SpyreFallbackError, match=r"aten\.median.*torch\.float32\[4, 3\]@spyre:0"
        ):
            torch.median(x)
    assert torch.equal(x.cpu(), x.cpu())  # the tensor is intact


def test_bad_policy_rejected():
    with pytest.raises(ValueError, match="warn"):
        torch_spyre.set_fallback_policy("sometimes")


def test_results_match_cpu():
    torch.manual_seed(0)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    sa, sb = a.to("spyre"), b.to("spyre")
    torch.testing.assert_close((sa @ sb).cpu(), a @ b)
    torch.testing.assert_close(torch.softmax(sa, -1).cpu(), torch.softmax(a, -1))
    vals, idx = torch.max(sa, dim=1)
    torch.testing.assert_close(vals.cpu(), a.max(1).values)
    assert torch.equal(idx.cpu(), a.max(1).indices)


def test_in_place_ops_on_views():
    x = torch.randn(6, 80)
    y = x.to("spyre")
    y[2:4, 10:70].mul_(3).add_(1)
    x[2:4, 10:70].mul_(3).add_(1)
    torch.testing.assert_close(y.cpu(), x)
    y.t()[5].zero_()
    x.t()[5].zero_()
    torch.testing.assert_close(y.cpu(), x)


def test_out_argument_is_written_and_resized():
    a = torch.randn(3, 4).to("spyre")
    out = torch.empty(0, device="spyre")
    torch.add(a, 1, out=out)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out.cpu(), a.cpu() + 1)


def test_view_ops_alias_instead_of_copying():
    y = torch.arange(10.0).to("spyre")
    w = y.unfold(0, 4, 2)  # a view op with no composite kernel
    assert w.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    torch.testing.assert_close(w.cpu(), torch.arange(10.0).unfold(0, 4, 2))


def test_factories_on_spyre():
    assert torch.equal(torch.arange(5, device="spyre").cpu(), torch.arange(5))
    assert torch.equal(torch.zeros(2, 3, device="spyre").cpu(), torch.zeros(2, 3))
    assert torch.equal(torch.full((2, 2), 7, device="spyre").cpu(), torch.full((2, 2), 7))
    assert torch.equal(torch.eye(3, device="spyre").cpu(), torch.eye(3))


def test_autograd_through_fallback():
    x = torch.randn(4, 3)
    w = torch.randn(3, 2)
    xs = x.to("spyre").requires_grad_()
    ws = w.to("spyre").requires_grad_()
    (xs @ ws).tanh().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr).tanh().sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), xr.grad)
    torch.testing.assert_close(ws.grad.cpu(), wr.grad)


def test_fallback_transfers_are_modelled():
    from torch_spyre.runtime import cards

    x = torch.randn(64, 64).to("spyre")
    before = cards.card(0).stats()["transfer_bytes"]
    torch.median(x)
    after = cards.card(0).stats()["transfer_bytes"]
    # the input went to the host, the median came back (an op without a kernel)
    assert after["d2h"] - before["d2h"] >= 64 * 64 * 4
    assert after["h2d"] > before["h2d"]


def test_unsupported_output_dtype_is_a_clear_error():
    x = torch.randn(3).to("spyre")
    with pytest.raises(TypeError, match="does not store Double"):
        x.double()
    assert torch.equal(x.cpu(), x.cpu())


def test_fallback_outputs_keep_the_cpu_kernels_strides():
    """A host-fallback result keeps the strides of torch's CPU kernel, which
    its meta kernel promised (a compiled graph asserts them: Qwen3-Next's
    triangular solve in the architecture sweep)."""
    torch.manual_seed(0)
    a = torch.randn(2, 8, 8).triu() + 4 * torch.eye(8)
    b = torch.randn(2, 8, 3)
    ref = torch.linalg.solve_triangular(a, b, upper=True)
    with fallback_policy("silent"):
        got = torch.linalg.solve_triangular(a.to("spyre"), b.to("spyre"), upper=True)
    assert got.stride() == ref.stride() and ref.stride() != b.stride()
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-6)


def test_eager_kernels_after_a_graph_break_are_not_traced_by_dynamo():
    """A compiled function that breaks its graph runs the rest eagerly with
    Dynamo's frame hook installed; the spyre kernels it calls (Python frames
    of the simulator) must not be compiled in turn (runtime.registration.entry:
    the MPT config of the architecture sweep took over 15 minutes before)."""
    from torch._dynamo.utils import counters

    def f(x):
        y = torch.softmax(x * 2, dim=-1)
        s = y.amax().item()  # a graph break that reads a value (MPT's)
        return (y.sum(-1) + x.amax(-1) * s).tanh()

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 8)
    with torch.no_grad():
        got = torch.compile(f)(x.to("spyre"))
    # the function and its resume after the break, nothing else
    assert counters["frames"]["total"] <= 3, dict(counters["frames"])
    torch.testing.assert_close(got.cpu(), f(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
