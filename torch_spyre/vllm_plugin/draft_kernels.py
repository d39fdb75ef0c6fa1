"""The drafter's input kernels (vLLM's ``v1/spec_decode/utils.py``) in torch ops.

Model-based drafters (``DraftModelProposer``, ``EagleProposer``: vLLM's
``SpecDecodeBaseProposer``) prepare each draft pass with four Triton kernels;
the pure-Python vLLM build runs no Triton, and vLLM's CPU stand-ins
(``vllm.utils.cpu_triton_utils``) call C++ ops (``torch.ops._C``) that build
lacks. Here they are as plain, vectorised torch ops, registered with the
rejection-sampler kernels (spec_decode.py) through
``Platform.register_triton_kernel_overrides`` (kernels.OVERRIDES). Each works
on the device of its tensors (the drafter's bookkeeping tensors are host
tensors: the runner's device is "cpu" towards vLLM); no Python loop over
requests or tokens, no ``.item()``. Parameter names are the Triton kernels'
(vLLM launches them by keyword). tests/vllm/test_vllm_draft_kernels.py checks
each against a loop transcription of vLLM's kernel.
"""

from __future__ import annotations

import torch


def _scatter(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> None:
    """``out[idx[m]] = vals[m]`` where ``mask``, without a data-dependent shape:
    masked-off writes go to one spare element past the end, then dropped."""
    n = out.numel()
    spare = torch.cat([out.reshape(-1), out.new_zeros(1)])
    where = torch.where(mask, idx.to(torch.int64), torch.full_like(idx, n, dtype=torch.int64))
    spare.scatter_(0, where.reshape(-1), vals.to(out.dtype).reshape(-1))
    out.copy_(spare[:n].reshape(out.shape))


def eagle_step_slot_mapping_metadata(
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    seq_lens_ptr: torch.Tensor,
    out_clamped_positions_ptr: torch.Tensor,
    out_slot_mapping_ptr: torch.Tensor,
    block_size: int,
    max_model_len: int,
    n_blocks_per_req: int,
    PAD_ID: int,  # noqa: N803 - the Triton kernel's parameter names
    batch_size: int,
) -> None:
    """``eagle_step_slot_mapping_metadata_kernel``: one draft step further for
    each request: position + 1 (0 past ``max_model_len``), its KV slot from the
    block table (``PAD_ID`` past the end and for the padding rows beyond
    ``batch_size``), seq_len + 1 (1 past the end), seq_lens updated in place."""
    b = int(batch_size)
    bs = int(block_size)
    pos = positions_ptr[:b].to(torch.int64) + 1
    exceeds = pos >= int(max_model_len)
    clamped = torch.where(exceeds, torch.zeros_like(pos), pos)
    block_no = (clamped // bs).clamp(max=int(n_blocks_per_req) - 1)
    rows = torch.arange(b, dtype=torch.int64, device=pos.device)
    block_id = block_table_ptr[rows, block_no].to(torch.int64)
    slot = block_id * bs + clamped % bs
    slot = torch.where(exceeds, torch.full_like(slot, int(PAD_ID)), slot)
    seq = seq_lens_ptr[:b].to(torch.int64)
    new_seq = torch.where(exceeds, torch.ones_like(seq), seq + 1).clamp(max=int(max_model_len))
    out_clamped_positions_ptr[:b] = clamped.to(out_clamped_positions_ptr.dtype)
    out_slot_mapping_ptr[:b] = slot.to(out_slot_mapping_ptr.dtype)
    out_slot_mapping_ptr[b:] = int(PAD_ID)
    seq_lens_ptr[:b] = new_seq.to(seq_lens_ptr.dtype)


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    query_start_loc_gpu_ptr: torch.Tensor,
    token_indices_to_sample_ptr: torch.Tensor,
    num_rejected_tokens_gpu_ptr: torch.Tensor,
    num_reqs: int,
) -> None:
    """``eagle_prepare_inputs_padded_kernel``: per request, the rejected drafts
    (drafts + 1 - valid sampled tokens, 0 without drafts) and the index of
    the last accepted token (the query's last token minus the rejected)."""
    n = int(num_reqs)
    cu = cu_num_draft_tokens_ptr[:n].to(torch.int64)
    drafts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    valid = valid_sampled_tokens_count_ptr[:n].to(torch.int64)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, torch.zeros_like(drafts))
    last = query_start_loc_gpu_ptr[1 : n + 1].to(torch.int64) - 1
    token_indices_to_sample_ptr[:n] = (last - rejected).to(token_indices_to_sample_ptr.dtype)
    num_rejected_tokens_gpu_ptr[:n] = rejected.to(num_rejected_tokens_gpu_ptr.dtype)


def eagle_prepare_next_token_padded(
    sampled_token_ids_ptr: torch.Tensor,
    discard_request_mask_ptr: torch.Tensor,
    backup_next_token_ids_ptr: torch.Tensor,
    next_token_ids_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
    stride_sampled_token_ids: int | None = None,
    BLOCK_SIZE_TOKENS: int | None = None,  # noqa: N803
) -> None:
    """``eagle_prepare_next_token_padded_kernel``: per request, the valid
    sampled tokens (not -1, inside the vocabulary) and the last of them as the
    next token; the backup token when none is valid or the request is discarded
    (then 0 valid)."""
    n = int(num_reqs)
    w = int(num_sampled_tokens_per_req)
    tok = sampled_token_ids_ptr[:n, :w].to(torch.int64)
    valid = (tok != -1) & (tok < int(vocab_size))
    count = valid.to(torch.int64).sum(1)
    col = torch.arange(w, dtype=torch.int64, device=tok.device).unsqueeze(0)
    last_col = torch.where(valid, col, torch.full_like(col, -1)).amax(1).clamp(min=0)
    last = tok.gather(1, last_col.unsqueeze(1)).squeeze(1)
    discard = discard_request_mask_ptr[:n].to(torch.bool)
    backup = backup_next_token_ids_ptr[:n].to(torch.int64)
    nxt = torch.where(discard | (count == 0), backup, last)
    next_token_ids_ptr[:n] = nxt.to(next_token_ids_ptr.dtype)
    count = torch.where(discard, torch.zeros_like(count), count)
    valid_sampled_tokens_count_ptr[:n] = count.to(valid_sampled_tokens_count_ptr.dtype)


def copy_and_expand_eagle_inputs(
    target_token_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    next_token_ids_ptr: torch.Tensor,
    out_input_ids_ptr: torch.Tensor,
    out_positions_ptr: torch.Tensor,
    out_is_rejected_token_mask_ptr: torch.Tensor,
    out_is_masked_token_mask_ptr: torch.Tensor,
    out_new_token_indices_ptr: torch.Tensor,
    out_hidden_state_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    query_end_loc_ptr: torch.Tensor,
    padding_token_id: int,
    parallel_drafting_token_id: int,
    total_input_tokens: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
    BLOCK_SIZE_TOKENS: int | None = None,  # noqa: N803
) -> None:
    """``copy_and_expand_eagle_inputs_kernel``: each request's accepted input
    tokens (shifted by one for EAGLE), then its bonus token, then
    ``num_padding_slots_per_request - 1`` parallel-drafting slots, then its
    rejected slots (padding token, position 0, flagged rejected), laid out
    request after request; positions count on from the request's first.
    Also the index of each new (bonus / parallel) token and, with the shift,
    where each input hidden state goes."""
    p = int(num_padding_slots_per_request)
    shift = bool(shift_input_ids)
    qel = query_end_loc_ptr.to(torch.int64)
    b = qel.shape[0]
    dev = qel.device
    qs = query_start_loc_ptr[:b].to(torch.int64)
    nqs = query_start_loc_ptr[1 : b + 1].to(torch.int64)
    req = torch.arange(b, dtype=torch.int64, device=dev)
    if shift:
        n_valid = qel - qs
        out_start = qs + req * (p - 1)
    else:
        n_valid = qel - qs + 1
        out_start = qs + req * p
    n_rejected = nqs - qel - 1
    total_out = (n_valid + p + n_rejected).unsqueeze(1)
    # [B, J]: J bounds every request's output slots (its inputs + p)
    j = torch.arange(int(total_input_tokens) + p, dtype=torch.int64, device=dev).unsqueeze(0)
    nv = n_valid.unsqueeze(1)
    in_bounds = j < total_out
    valid_region = j < nv
    bonus_region = j == nv
    parallel_region = (j > nv) & (j < nv + p)
    rejected_region = j >= nv + p
    out_idx = out_start.unsqueeze(1) + j
    in_idx = (qs.unsqueeze(1) + int(shift) + j).clamp(max=int(total_input_tokens) - 1)
    tokens = target_token_ids_ptr.to(torch.int64)[in_idx]
    tokens = torch.where(valid_region & in_bounds, tokens, torch.zeros_like(tokens))
    bonus = next_token_ids_ptr[:b].to(torch.int64).unsqueeze(1).expand_as(tokens)
    tokens = torch.where(bonus_region, bonus, tokens)
    tokens = torch.where(
        parallel_region, torch.full_like(tokens, int(parallel_drafting_token_id)), tokens
    )
    tokens = torch.where(rejected_region, torch.full_like(tokens, int(padding_token_id)), tokens)
    start_pos = target_positions_ptr.to(torch.int64)[qs].unsqueeze(1)
    positions = torch.where(rejected_region, torch.zeros_like(j), start_pos + j)
    _scatter(out_input_ids_ptr, out_idx, tokens, in_bounds)
    _scatter(out_positions_ptr, out_idx, positions, in_bounds)
    _scatter(out_is_rejected_token_mask_ptr, out_idx, rejected_region & in_bounds, in_bounds)
    _scatter(out_is_masked_token_mask_ptr, out_idx, parallel_region & in_bounds, in_bounds)
    new_region = (j >= nv) & (j < nv + p) & in_bounds
    new_idx = req.unsqueeze(1) * p + (j - nv)
    _scatter(out_new_token_indices_ptr, new_idx, out_idx, new_region)
    if shift:
        src = qs.unsqueeze(1) + j
        _scatter(out_hidden_state_mapping_ptr, src, out_idx, j < (nqs - qs).unsqueeze(1))


_U = "vllm.v1.spec_decode.utils."
#: vLLM's drafter-input Triton kernels -> these (kernels.OVERRIDES)
OVERRIDES = {
    _U + "eagle_step_slot_mapping_metadata_kernel": eagle_step_slot_mapping_metadata,
    _U + "eagle_prepare_inputs_padded_kernel": eagle_prepare_inputs_padded,
    _U + "eagle_prepare_next_token_padded_kernel": eagle_prepare_next_token_padded,
    _U + "copy_and_expand_eagle_inputs_kernel": copy_and_expand_eagle_inputs,
}
