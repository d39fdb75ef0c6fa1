"""Printing spyre tensors (guards the torch._tensor_str wrapper)."""

import torch

from torch_spyre.runtime import printing


def test_repr_shows_values_and_device():
    t = torch.arange(5.0, device="spyre")
    assert repr(t) == "tensor([0., 1., 2., 3., 4.], device='spyre:0')"
    h = torch.tensor([1.5, 2.0], dtype=torch.float16).to("spyre")
    assert repr(h) == "tensor([1.5000, 2.0000], device='spyre:0', dtype=torch.float16)"
    assert "size=(0, 3)" in repr(torch.empty(0, 3, device="spyre"))
    g = torch.ones(2, device="spyre", requires_grad=True) * 2
    assert "grad_fn=<MulBackward0>" in repr(g)


def test_wrapper_is_installed():
    import torch._tensor_str as ts

    assert ts._str is printing._str


def test_fake_spyre_tensors_print_without_values():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        t = mode.from_tensor(torch.ones(3, device="spyre"))
        text = repr(t)
    assert "device='spyre:0'" in text and "size=(3,)" in text
    p = torch.nn.Parameter(torch.ones(2, device="spyre"))
    assert "tensor([1., 1.], device='spyre:0', requires_grad=True)" in repr(p)
