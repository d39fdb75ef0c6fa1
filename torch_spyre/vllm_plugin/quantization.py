"""fp8 weights served on the card: vLLM's fp8 linear layers run spyre's kernel.

vLLM picks the kernel of an fp8 linear layer per platform from its kernel
tables (``vllm.model_executor.kernels.linear``); ``register()`` adds
``SpyreFp8LinearKernel`` for the out-of-tree platform, which serves:

* ``--quantization fp8`` on an fp16/bf16 checkpoint (vLLM 0.32 reads it as
  ``fp8_per_tensor``: ``Fp8PerTensorOnlineLinearMethod`` quantises each weight
  at load, one fp32 scale ``amax / 448`` per tensor) and ``fp8_per_channel``;
* fp8 checkpoints (``quant_method: fp8``, ``Fp8LinearMethod``) and
  compressed-tensors fp8 checkpoints (weight-only: ``CompressedTensorsW8A16Fp8``;
  with activation schemes: ``CompressedTensorsW8A8Fp8``), per-tensor or
  per-channel weight scales.

The kernel is weight-only (W8A16): the 8-bit weight streams from device memory
(half the bytes of fp16) and is dequantised in LX, the PE array multiplies
16-bit activations (``torch.ops.spyre.quantized_linear``; compiled, the
dequantisation is planned into the matmul, docs/compiler.md).  Activations are
not quantised: vLLM's dynamic per-tensor activation scale is a maximum over the
whole step, which would make one request's tokens depend on the others in the
batch and on the token bucket's padding rows; a checkpoint's static input
scales are ignored (as vLLM's own W8A16 path does).

Two registrations reach past vLLM's public surface, both covered by
tests/vllm/test_vllm_quantized.py:

* ``register_linear_kernel`` has no kernel type for weight-only fp8 (vLLM's
  ``init_wfp8_a16_linear_kernel`` table): the entry it would make is added to
  ``_POSSIBLE_WFP8A16_KERNELS`` for ``PlatformEnum.OOT``;
* the online fp8 method quantises weights with vLLM's C++ op
  ``_C::static_scaled_fp8_quant``, which the pure-Python vLLM build does not
  have: ``kernels.register_c_ops`` (the platform's ``import_kernels``) defines
  a torch stand-in with the same schema.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.kernels.linear import FP8ScaledMMLinearKernel, register_linear_kernel
from vllm.platforms import PlatformEnum

logger = init_logger(f"vllm.{__name__}")

_registered: list[bool] = []


class SpyreFp8LinearKernel(FP8ScaledMMLinearKernel):
    """An fp8 linear layer on the card: W8A16 (``spyre.quantized_linear``)."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        from vllm.platforms import current_platform

        if getattr(current_platform, "device_name", None) != "spyre":
            return False, "the spyre kernel runs on the spyre platform only"
        return True, None

    @classmethod
    def can_implement(cls, c) -> tuple[bool, str | None]:
        gs = c.weight_quant_key.scale.group_shape
        if gs.is_per_tensor() or gs.is_per_channel():
            return True, None
        return False, "spyre takes one fp8 weight scale per tensor or per output channel"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm.model_executor.utils import replace_parameter

        # vLLM's fp8 methods hand the weight over as (K, N), the transpose of
        # an [N, K] tensor: the card reads it as [N, K], as it lies
        w = layer.weight.t()
        if tuple(w.shape) != tuple(self.config.weight_shape) or w.dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"SpyreFp8LinearKernel: expected a (K, N) float8_e4m3fn weight of "
                f"[N, K] = {list(self.config.weight_shape)}, got {layer.weight.dtype} "
                f"{list(layer.weight.shape)}"
            )
        n = w.shape[0]
        scale = layer.weight_scale.detach().to(torch.float32)
        # one scale per channel as a vector (an [N, 1] column would take a stick each)
        scale = scale.reshape(n) if scale.numel() == n and n > 1 else scale.reshape(-1)[:1]
        if layer.weight_scale.numel() not in (1, n):
            raise NotImplementedError(
                f"SpyreFp8LinearKernel: weight_scale {list(layer.weight_scale.shape)} for {n} "
                "output channels (block scales are not supported on spyre)"
            )
        replace_parameter(layer, "weight", w.contiguous())
        replace_parameter(layer, "weight_scale", scale.contiguous())

    def apply_weights(self, layer: torch.nn.Module, x, bias=None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise NotImplementedError(
                "SpyreFp8LinearKernel takes 16-bit activations (W8A16), not pre-quantised ones"
            )
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return torch.ops.spyre.quantized_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_scaled_mm(self, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            "SpyreFp8LinearKernel runs through apply_weights (W8A16); apply_scaled_mm is unused"
        )


def register() -> None:
    """Add ``SpyreFp8LinearKernel`` to vLLM's fp8 kernel tables (idempotent)."""
    if _registered:
        return
    from vllm.model_executor.kernels import linear

    import torch_spyre  # noqa: F401  (torch.ops.spyre.quantized_linear)

    register_linear_kernel(SpyreFp8LinearKernel, PlatformEnum.OOT, kernel_type="fp8")
    # weight-only fp8 (compressed-tensors W8A16Fp8): no kernel type for it in
    # register_linear_kernel, so the table entry it would make (see module doc)
    table = linear._POSSIBLE_WFP8A16_KERNELS
    if SpyreFp8LinearKernel not in table.setdefault(PlatformEnum.OOT, []):
        table[PlatformEnum.OOT].append(SpyreFp8LinearKernel)
    _registered.append(True)
