"""Misuse raises a Python exception that says what was wrong; nothing crashes."""

import pytest
import torch

CASES = {
    "negative size": (lambda: torch.empty(-1, device="spyre"), RuntimeError, "negative dimension"),
    "missing card": (lambda: torch.ones(2).to("spyre:9"), RuntimeError, "spyre:9 does not exist"),
    "negative card": (lambda: torch.spyre.set_device(-1), RuntimeError, "does not exist"),
    "negative storage": (
        lambda: torch.UntypedStorage(-5, device="spyre"),
        RuntimeError,
        "negative number of bytes",
    ),
    "view past the storage": (
        lambda: torch.ones(4, device="spyre").as_strided((100,), (1,)).cpu(),
        RuntimeError,
        "out of bounds",
    ),
    "host storage on a device tensor": (
        lambda: torch.empty(0, device="spyre").set_(torch.ones(3).untyped_storage()),
        RuntimeError,
        "different device",
    ),
    "laid-out storage cannot grow in place": (
        lambda: torch.empty(0, device="spyre").set_(
            torch.ones(3, device="spyre").untyped_storage(), 10, (5,), (1,)
        ),
        RuntimeError,
        "cannot grow in\\s+place",
    ),
    "negative resize": (
        lambda: torch.ones(3, device="spyre").resize_(-2),
        RuntimeError,
        "negative",
    ),
    "float64": (lambda: torch.zeros(3, device="spyre", dtype=torch.float64), TypeError, "Double"),
    "complex128": (lambda: torch.ones(3, dtype=torch.complex128).to("spyre"), TypeError, "Complex"),
    "matmul shapes": (
        lambda: torch.ones(3, 4, device="spyre") @ torch.ones(5, 6, device="spyre"),
        RuntimeError,
        "cannot be multiplied",
    ),
    "mixed devices": (
        lambda: torch.ones(3, device="spyre") + torch.ones(3),
        RuntimeError,
        "same device",
    ),
    "impossible size": (lambda: torch.empty(2**62, device="spyre"), RuntimeError, "overflow"),
    "bad view": (lambda: torch.ones(6, device="spyre").view(4), RuntimeError, "invalid"),
    "item of many": (lambda: torch.ones(3, device="spyre").item(), RuntimeError, "3 elements"),
    "index out of range": (
        lambda: torch.ones(3, device="spyre")[torch.tensor([5]).to("spyre")],
        IndexError,
        "out of bounds",
    ),
    "integer division by zero": (
        lambda: torch.ones(3, dtype=torch.int32, device="spyre") // 0,
        RuntimeError,
        "ZeroDivisionError",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_is_a_clear_python_error(name):
    fn, exc, match = CASES[name]
    keep = torch.arange(5.0).to("spyre")
    with pytest.raises(exc, match=match):
        fn()
    assert torch.equal(keep.cpu(), torch.arange(5.0))  # other tensors intact
    assert torch.spyre.current_device() == 0
