"""Bugs the op-coverage run found, pinned."""

import torch
import torch.nn.functional as F


def S(t):
    return t.to("spyre")


def test_scalar_position_is_part_of_the_kernel_key():
    s = S(torch.tensor([0.25, 2.0]))
    assert torch.equal((s - 1).cpu(), torch.tensor([-0.75, 1.0]))
    assert torch.equal((1 - s).cpu(), torch.tensor([0.75, -1.0]))


def test_batch_norm_updates_running_stats():
    x = torch.randn(4, 3, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    srm, srv = S(rm), S(rv)
    F.batch_norm(S(x), srm, srv, training=True)
    F.batch_norm(x, rm, rv, training=True)
    torch.testing.assert_close(srm.cpu(), rm)
    torch.testing.assert_close(srv.cpu(), rv)


def test_wrapped_number_operands():
    x = torch.randn(5)
    s = S(x)
    torch.testing.assert_close(torch.copysign(s, -1.5).cpu(), torch.copysign(x, -1.5))
    torch.testing.assert_close((s % 2).cpu(), x % 2)
    torch.testing.assert_close(torch.fmod(s, 2).cpu(), torch.fmod(x, 2))


def test_convolutions_run_and_train():
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 3, 3, requires_grad=True)
    xs, ws = S(x.detach()).requires_grad_(), S(w.detach()).requires_grad_()
    torch.testing.assert_close(F.conv1d(xs, ws).cpu(), F.conv1d(x, w))
    F.conv1d(xs, ws).sum().backward()
    F.conv1d(x, w).sum().backward()
    torch.testing.assert_close(xs.grad.cpu(), x.grad)
    torch.testing.assert_close(ws.grad.cpu(), w.grad)


def test_layer_norm_statistics_keep_the_input_dtype():
    x = torch.randn(1, 2, 3, dtype=torch.half)
    ref = torch.native_layer_norm(x, (1, 2, 3), None, None, 0.5)
    got = torch.native_layer_norm(S(x), (1, 2, 3), None, None, 0.5)
    assert [t.dtype for t in got] == [t.dtype for t in ref]


def test_out_and_in_place_results_of_another_dtype():
    a, b = torch.randn(5, dtype=torch.half), torch.randn(5, dtype=torch.half)
    torch.testing.assert_close(
        F.cosine_similarity(S(a[0]), S(b[0]), dim=0).cpu(),
        F.cosine_similarity(a[0], b[0], dim=0),
        rtol=1e-2,
        atol=1e-2,
    )
    t, u = torch.randn(5), torch.randn(5)
    assert torch.equal(S(t).eq_(S(u)).cpu(), t.clone().eq_(u))


def test_bf16_trunc_division_rounds_once():
    a = torch.tensor([-3.890625], dtype=torch.bfloat16)
    b = torch.tensor([-0.216796875], dtype=torch.bfloat16)
    assert torch.equal(
        torch.div(S(a), S(b), rounding_mode="trunc").cpu(), torch.div(a, b, rounding_mode="trunc")
    )


def test_errors_name_the_op_and_shapes():
    import pytest

    with pytest.raises(RuntimeError, match=r"aten\.mm\.default on float32\[3, 4\]@spyre:0"):
        S(torch.ones(3, 4)) @ S(torch.ones(5, 6))
