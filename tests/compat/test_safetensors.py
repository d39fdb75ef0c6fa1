"""Checkpoints straight to the card: safetensors with device="spyre" (the
wrapper in torch_spyre/compat/safetensors.py; safetensors itself rejects the device)."""

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    tensors = {"w": torch.arange(12, dtype=torch.float16).reshape(3, 4), "b": torch.ones(4)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("device", ["spyre", "spyre:0", torch.device("spyre")])
def test_load_file_to_spyre(checkpoint, device):
    path, tensors = checkpoint
    out = load_file(str(path), device=device)
    assert set(out) == set(tensors)
    for k, t in tensors.items():
        assert out[k].device.type == "spyre"
        assert torch.equal(out[k].cpu(), t)


def test_safe_open_to_spyre(checkpoint):
    path, tensors = checkpoint
    with safe_open(str(path), framework="pt", device="spyre") as f:
        assert set(f.keys()) == set(tensors)
        w = f.get_tensor("w")
        rows = f.get_slice("w")[1:]
    assert w.device.type == "spyre" and torch.equal(w.cpu(), tensors["w"])
    assert rows.device.type == "spyre" and torch.equal(rows.cpu(), tensors["w"][1:])


def test_cpu_untouched(checkpoint):
    path, tensors = checkpoint
    out = load_file(str(path))
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], tensors["w"])
