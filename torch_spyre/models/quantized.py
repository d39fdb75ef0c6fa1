"""Quantised linear layers for stock models: 8-bit weights on the card.

``QuantizedLinear`` holds an 8-bit weight (``float8_e4m3fn`` or ``int8``,
``[out, in]``) and its scale (one per tensor or per output channel) and runs
``torch.ops.spyre.quantized_linear`` (torch_spyre/ops/quantized.py): on the card
the weight streams in as 8-bit data, half the bytes of fp16, and is
dequantised in LX; on the CPU the same op dequantises, then ``F.linear``, so a
model quantised here is its own CPU reference.

* ``quantize(model)``: every ``nn.Linear`` (but ``lm_head``) replaced in place,
  its weight quantised with ``scale = amax / qmax`` per output channel or per
  tensor (fp8: ``qmax`` = 448, int8: 127; the rule of vLLM's online fp8 and of
  compressed-tensors' min-max observer);
* ``from_compressed_tensors(model)``: a transformers model loaded from a
  compressed-tensors checkpoint of 8-bit weights (``float-quantized`` /
  ``int-quantized``, per-tensor or per-channel, weight only) keeps its 8-bit
  weights: its linear layers become ``QuantizedLinear`` and compressed-tensors'
  decompress-on-first-forward hook is removed (``ModelCompressor``'s own handle,
  ``model.ct_decompress_hook``).  Its CPU reference is the same checkpoint as
  transformers runs it (weights dequantised once: the same rule,
  ``(q.to(scale.dtype) * scale).to(dtype)``).

``prepare`` (torch_spyre.models) applies ``from_compressed_tensors`` to every model.
"""

from __future__ import annotations

import torch
from torch import nn

import torch_spyre  # noqa: F401  (torch.ops.spyre.quantize / quantized_linear)

#: weight types of quantised layers
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(weight, weight_scale).T + bias``, the weight kept 8-bit."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2:
            raise TypeError(
                f"QuantizedLinear: a 2-D weight of {', '.join(map(str, WEIGHT_DTYPES))}, got "
                f"{weight.dtype} {list(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        # one scale per output channel as a vector ([N], 32 fp32 per stick; an
        # [N, 1] column would take a whole stick per channel), or one element
        n = self.out_features
        scale = weight_scale.reshape(n if weight_scale.numel() == n and n > 1 else 1)
        if weight_scale.numel() not in (1, n):
            raise NotImplementedError(
                f"QuantizedLinear: weight_scale {list(weight_scale.shape)} for {n} output "
                "channels; spyre takes one scale per tensor or per output channel"
            )
        self.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return torch.ops.spyre.quantized_linear(x, self.weight, self.weight_scale, bias)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() would cast every floating tensor, the fp8
        # weight and its fp32 scale included (silently dequantising the layer):
        # a cast moves them only, the bias follows the model's dtype
        probe = fn(torch.zeros((), dtype=torch.float32))
        if probe.dtype == torch.float32:
            return super()._apply(fn, recurse)
        for name in ("weight", "weight_scale"):
            p = getattr(self, name)
            p.data = p.data.to(probe.device)
        if self.bias is not None:
            self.bias.data = fn(self.bias.data)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight={str(self.weight.dtype).removeprefix('torch.')}, "
            f"scale={list(self.weight_scale.shape)}, bias={self.bias is not None}"
        )


def quantize_weight(
    weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, granularity: str = "channel"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, fp32 scale [N, 1] or [1]) with ``scale = amax / qmax``."""
    if dtype not in WEIGHT_DTYPES:
        raise TypeError(f"quantize_weight: {dtype} is not one of {WEIGHT_DTYPES}")
    w = weight.detach().float()
    if granularity == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    elif granularity == "tensor":
        amax = w.abs().amax().reshape(1)
    else:
        raise ValueError(f"granularity is 'channel' or 'tensor', got {granularity!r}")
    qmax = 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)
    scale = (amax / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.ops.spyre.quantize(w, scale, dtype), scale


def quantize(
    model: nn.Module,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "channel",
    skip: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (but the ``skip`` names) by a
    ``QuantizedLinear`` of its weight, in place; returns ``model``."""
    for name, parent, child in list(_linears(model)):
        if name.split(".")[-1] in skip:
            continue
        wq, scale = quantize_weight(child.weight, dtype, granularity)
        bias = None if child.bias is None else child.bias.detach().clone()
        setattr(parent, name.split(".")[-1], QuantizedLinear(wq, scale, bias))
    model.spyre_quantized = f"{str(dtype).removeprefix('torch.')} per {granularity}"
    return model


def quantize_meta(model: nn.Module, dtype: torch.dtype = torch.float8_e4m3fn) -> nn.Module:
    """``quantize`` for a model on the meta device (no values: estimates):
    every ``nn.Linear`` becomes a ``QuantizedLinear`` of an 8-bit weight and
    one fp32 scale per output channel, shapes only."""
    for name, parent, child in list(_linears(model)):
        n, k = child.weight.shape
        w = torch.empty((n, k), dtype=dtype, device=child.weight.device)
        s = torch.empty((n,), dtype=torch.float32, device=child.weight.device)
        layer = QuantizedLinear(w, s, child.bias)
        setattr(parent, name.split(".")[-1], layer)
    return model


def from_compressed_tensors(model: nn.Module) -> int:
    """Keep the 8-bit weights of a model loaded from a compressed-tensors
    checkpoint: its compressed linear layers become ``QuantizedLinear``.
    Returns how many; 0 for any other model (nothing changes)."""
    found = [
        (name, parent, child)
        for name, parent, child in _linears(model)
        if child.weight.dtype in WEIGHT_DTYPES and hasattr(child, "weight_scale")
    ]
    for name, parent, child in found:
        scheme = getattr(child, "quantization_scheme", None)
        acts = getattr(scheme, "input_activations", None)
        if acts is not None:
            raise NotImplementedError(
                f"{name}: compressed-tensors scheme with quantised input activations "
                f"({acts.type}{acts.num_bits}, {acts.strategy}); spyre runs weight-only "
                "checkpoints (W8A16: fp8 or int8 weights, activations in the model dtype)"
            )
        zp = getattr(child, "weight_zero_point", None)
        if zp is not None and bool((zp != 0).any()):
            raise NotImplementedError(f"{name}: asymmetric weights (a zero point) on spyre")
        bias = None if child.bias is None else child.bias.detach()
        layer = QuantizedLinear(child.weight.detach(), child.weight_scale.detach(), bias)
        setattr(parent, name.split(".")[-1], layer)
    hook = getattr(model, "ct_decompress_hook", None)
    if found and hook is not None:
        # compressed-tensors' decompress-on-first-forward (ModelCompressor's
        # handle): the weights stay compressed, the layers above run them
        hook.remove()
        del model.ct_decompress_hook
    if found:
        model.spyre_quantized = "compressed-tensors"
    return len(found)


def _linears(model: nn.Module):
    for name, child in model.named_modules():
        if type(child) is nn.Linear:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            yield name, parent, child


def save_compressed_tensors(
    model: nn.Module,
    path,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "channel",
    ignore: tuple[str, ...] = ("lm_head",),
) -> None:
    """Save a float ``model`` as a compressed-tensors checkpoint of 8-bit weights
    (weight only: fp8 ``float-quantized`` or int8 ``int-quantized``, scales per
    output channel or per tensor, ``amax / qmax`` as compressed-tensors' min-max
    observer computes them), with compressed-tensors' own compressor: what
    llm-compressor writes for such a recipe.  Needs ``compressed-tensors``.
    ``model`` is changed (quantised and compressed)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    fp = dtype != torch.int8
    if dtype not in (torch.float8_e4m3fn, torch.int8):
        raise TypeError("compressed-tensors stores 8-bit weights as float8_e4m3fn or int8")
    fmt = "float-quantized" if fp else "int-quantized"
    args = QuantizationArgs(
        num_bits=8, type="float" if fp else "int", strategy=granularity, symmetric=True
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config)
    for module in model.modules():
        if type(module) is nn.Linear and hasattr(module, "weight_scale"):
            _, scale = quantize_weight(module.weight, dtype, granularity)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
