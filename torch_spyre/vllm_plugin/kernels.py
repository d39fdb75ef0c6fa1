"""Pure-torch stand-ins for vLLM's Triton helper kernels and C++ ops.

The pure-Python vLLM build (``VLLM_TARGET_DEVICE=empty``) runs no Triton and has
no ``vllm._C``.  The Triton kernels below work on vLLM's host-side bookkeeping
tensors (the platform's device_type is "cpu"), so plain torch on the host is the
natural replacement (registered through
``Platform.register_triton_kernel_overrides``).  ``register_c_ops`` (called by
``Platform.import_kernels``, where vLLM loads its C++ ops) defines the C++ ops
vLLM's FusedMoE router calls (``_moe_C::topk_softmax`` / ``topk_sigmoid``, as
torch ops on the card) and the one the fp8 path calls: ``_C::static_scaled_fp8_quant``, quantising weights at
load time, as ``torch.ops.spyre.quantize``: ``(input / scale).clamp(-448, 448)``
to fp8 (true division, as vLLM's per-channel path; its CUDA kernel multiplies
by the reciprocal).
"""

from __future__ import annotations

import torch


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    slot_mapping_ptr: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,  # noqa: N803 - the Triton kernel's parameter names
    TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
    TOTAL_CP_RANK: int = 0,  # noqa: N803
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
    PAD_ID: int = -1,  # noqa: N803
    BLOCK_SIZE: int = 1024,  # noqa: N803
) -> None:
    """slot[t] = block_table[req(t), pos[t] // bs] * bs + pos[t] % bs; PAD_ID after.

    ``block_table.compute_slot_mapping``: token t belongs to the request whose
    [query_start_loc[r], query_start_loc[r+1]) range holds t.
    """
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported on spyre")
    n = int(num_tokens)
    bs = int(KV_CACHE_BLOCK_SIZE)
    qsl = query_start_loc_ptr.to(torch.int64)
    tokens = torch.arange(n, dtype=torch.int64)
    # right=True: the last request whose start <= t (empty requests are skipped).
    req = torch.searchsorted(qsl, tokens, right=True) - 1
    pos = positions_ptr[:n].to(torch.int64)
    table = block_table_ptr.reshape(-1, int(block_table_stride))
    blocks = table[req, pos // bs].to(torch.int64)
    slot_mapping_ptr[:n] = blocks * bs + pos % bs
    slot_mapping_ptr[n : int(max_num_tokens)] = PAD_ID


def _overrides() -> dict:
    from torch_spyre.vllm_plugin import draft_kernels, spec_decode

    return {
        "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
        # the rejection sampler's kernels (speculative decoding)
        **spec_decode.OVERRIDES,
        # the model-based drafters' input kernels (draft model, EAGLE)
        **draft_kernels.OVERRIDES,
    }


OVERRIDES = _overrides()


_c_lib: list[torch.library.Library] = []
_moe_lib: list[torch.library.Library] = []


def register_c_ops() -> None:
    """Torch stand-ins for the vLLM C++ ops the fp8 path calls at load time
    (the pure-Python build has none); nothing is defined where vllm._C exists."""
    _register_moe_router_ops()
    if _c_lib or hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        return
    import torch_spyre  # noqa: F401  (torch.ops.spyre.quantize)

    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale, "
        "int[]? group_shape=None) -> ()"
    )

    def static_scaled_fp8_quant(result, input, scale, group_shape=None) -> None:
        s = scale.to(torch.float32)
        if s.dim() == 1 and s.numel() > 1:
            # a 1-D scale needs its group shape: per token (1, -1), per channel (-1, 1)
            gs = tuple(group_shape or ())
            if gs == (1, -1):
                s = s.reshape(-1, 1)
            elif gs == (-1, 1):
                s = s.reshape(1, -1)
            else:
                raise NotImplementedError(
                    f"static_scaled_fp8_quant: a 1-D scale with group shape {gs or None}"
                )
        elif s.dim() > 2 or (s.dim() == 2 and s.shape != input.shape[:1] + (1,) and s.numel() > 1
                                and s.shape != (1,) + input.shape[1:]):  # fmt: skip
            raise NotImplementedError(f"static_scaled_fp8_quant: group scales {list(s.shape)}")
        result.copy_(torch.ops.spyre.quantize(input, s, result.dtype))

    lib.impl("static_scaled_fp8_quant", static_scaled_fp8_quant, "CompositeExplicitAutograd")
    _c_lib.append(lib)


def _topk_route(
    scores: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_expert_indices: torch.Tensor,
    renormalize: bool,
    bias: torch.Tensor | None,
    scaling: float = 1.0,
) -> None:
    """vLLM's fused top-k router, written in torch ops the card runs: the
    experts chosen by ``scores`` (+ ``bias``, which steers the choice only),
    their weights from ``scores``, renormalised to sum 1 when asked."""
    k = topk_ids.shape[-1]
    pick = scores if bias is None else scores + bias.to(scores.dtype)
    ids = torch.topk(pick, k, dim=-1).indices
    w = torch.gather(scores, -1, ids) if bias is not None else torch.topk(pick, k, dim=-1).values
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if scaling != 1.0:
        w = w * scaling
    topk_weights.copy_(w.to(topk_weights.dtype))
    topk_ids.copy_(ids.to(topk_ids.dtype))
    t = scores.shape[0]
    # expert slot j of token i: i + j * tokens (the CUDA kernel's layout)
    idx = torch.arange(k, dtype=torch.int64).mul(t).unsqueeze(0) + torch.arange(
        t, dtype=torch.int64
    ).unsqueeze(1)
    token_expert_indices.copy_(idx.to(token_expert_indices.dtype))


def _register_moe_router_ops() -> None:
    """``_moe_C::topk_softmax`` / ``topk_sigmoid`` (vLLM's FusedMoE router calls
    them through vllm._custom_ops): softmax / sigmoid over the router logits
    in fp32, then ``_topk_route``.  ``is_padding`` rows are routed like the
    others (their outputs are discarded by vLLM)."""
    if _moe_lib or hasattr(torch.ops._moe_C, "topk_softmax"):
        return
    lib = torch.library.Library("_moe_C", "FRAGMENT")
    lib.define(
        "topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_indices, "
        "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
        "Tensor? bias, Tensor? is_padding) -> ()"
    )
    lib.define(
        "topk_sigmoid(Tensor(a!) topk_weights, Tensor(b!) topk_indices, "
        "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
        "Tensor? bias, float routed_scaling_factor, Tensor? is_padding) -> ()"
    )

    def topk_softmax(w, ids, tei, gating, renormalize, bias=None, is_padding=None) -> None:
        _topk_route(torch.softmax(gating.float(), dim=-1), w, ids, tei, renormalize, bias)

    def topk_sigmoid(w, ids, tei, gating, renormalize, bias=None, scaling=1.0, is_padding=None):
        scores = torch.sigmoid(gating.float())
        _topk_route(scores, w, ids, tei, renormalize, bias, scaling)

    lib.impl("topk_softmax", topk_softmax, "CompositeExplicitAutograd")
    lib.impl("topk_sigmoid", topk_sigmoid, "CompositeExplicitAutograd")
    _moe_lib.append(lib)
