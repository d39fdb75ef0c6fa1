"""Pure-torch stand-ins for vLLM's Triton helper kernels.

The pure-Python vLLM build (``VLLM_TARGET_DEVICE=empty``) runs no Triton, and the
kernels below work on vLLM's host-side bookkeeping tensors (the platform's
device_type is "cpu"), so plain torch on the host is the natural replacement.
Registered through ``Platform.register_triton_kernel_overrides``.
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


OVERRIDES = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
}
