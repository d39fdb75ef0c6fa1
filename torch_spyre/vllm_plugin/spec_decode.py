"""Speculative decoding on spyre: vLLM's rejection-sampling kernels in torch ops.

vLLM's v1 model runner does speculative decoding itself (``GPUModelRunner``,
inherited through ``CPUModelRunner``): the drafter (``NgramProposer``, prompt
lookup on the host) proposes up to k tokens per request after each step; the
scheduler hands them back as ``scheduled_spec_decode_tokens``; the next step's
forward runs the k+1 positions of every request in ONE forward (the compiled
forward of the step's token bucket, compile.py: a decode with drafts is a short
chunk of query tokens to the attention backend); the LM head runs on the k+1
rows of each request; ``RejectionSampler`` keeps the accepted prefix and a
bonus or recovered token, so a request gains 1..k+1 tokens per step.

The rejection sampler's four Triton kernels have no Triton to run on here (the
pure-Python vLLM build), and vLLM's CPU stand-ins call C++ ops (``vllm._C``)
that build lacks. This module gives them as plain, vectorised torch ops
(registered through ``Platform.register_triton_kernel_overrides``, vLLM's
public hook for exactly this: kernels.OVERRIDES). Each works on the device of
its tensors: the host, where vLLM's sampler runs today (the logits come back
from the card, layers.py), or the card (tests/vllm/test_vllm_spec_decode.py
runs them on spyre tensors with no fallback). No Python loop over requests or
tokens, no ``.item()``.

Layout (vLLM's): drafts of all requests flattened, ``cu_num_draft_tokens[r]``
the end of request r's drafts; ``output_token_ids`` is [requests, max_spec_len + 1],
pre-filled with the placeholder -1.

* greedy: the longest prefix where draft == argmax of the target, then the
  target's argmax at the first mismatch, or the bonus token when all match;
* random (vLLM's rejection sampling): draft d at position i is accepted when
  ``p_target(d) / p_draft(d) >= u_i`` (``p_draft = 1`` for n-gram drafts, which
  have no probabilities); at the first rejection the *recovered* token is
  sampled from ``max(p_target - p_draft, 0)`` (n-gram: ``p_target`` without d)
  by the exponential race ``argmax(p / q)``, q ~ Exp(1) per request.
"""

from __future__ import annotations

import torch


def _req_of_token(cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens] request index of each flattened draft token."""
    cu = cu_num_draft_tokens.to(torch.int64)
    t = torch.arange(num_tokens, dtype=torch.int64, device=cu.device)
    return (t.unsqueeze(1) >= cu.unsqueeze(0)).sum(1)


def _padded(cu_num_draft_tokens: torch.Tensor, max_spec_len: int):
    """(counts [B], flat index [B, S] clamped into range, valid [B, S])."""
    cu = cu_num_draft_tokens.to(torch.int64)
    counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    start = cu - counts
    pos = torch.arange(max_spec_len, dtype=torch.int64, device=cu.device).unsqueeze(0)
    valid = pos < counts.unsqueeze(1)
    idx = (start.unsqueeze(1) + pos).clamp(min=0)
    return counts, idx, valid


def _prob_dtype(device: torch.device) -> torch.dtype:
    """float64 on the host (vLLM's precision for the acceptance test); the card
    stores no float64, so float32 there."""
    return torch.float64 if device.type == "cpu" else torch.float32


def _accepted_len(accepted: torch.Tensor) -> torch.Tensor:
    """[B] length of the all-True prefix of each row of [B, S]."""
    return torch.cumprod(accepted.to(torch.int64), dim=1).sum(1)


def _write(
    output_token_ids: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    n_acc: torch.Tensor,
    accepted_tok: torch.Tensor,
    stop_tok: torch.Tensor,
    bonus: torch.Tensor,
) -> None:
    """Row r (where ``rows[r]``): ``accepted_tok`` before ``n_acc``, ``stop_tok``
    at ``n_acc`` when a draft was rejected there, the bonus at ``counts`` when
    none was; the rest of the row is left as it is."""
    b, width = output_token_ids.shape
    s = width - 1
    col = torch.arange(width, dtype=torch.int64, device=counts.device).unsqueeze(0)
    pad = accepted_tok.new_zeros((b, 1))
    acc = torch.cat([accepted_tok, pad], 1)
    stop = torch.cat([stop_tok, pad], 1)
    n = n_acc.unsqueeze(1)
    c = counts.unsqueeze(1)
    all_ok = n == c
    rows = rows.unsqueeze(1)
    dtype = output_token_ids.dtype
    out = torch.where(rows & (col < n), acc.to(dtype), output_token_ids)
    out = torch.where(rows & (col == n) & (n < c), stop.to(dtype), out)
    bonus_col = bonus.reshape(b, 1).to(dtype).expand(b, width)
    out = torch.where(rows & all_ok & (col == c) & (c <= s), bonus_col, out)
    output_token_ids.copy_(out)


def rejection_greedy_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    target_argmax_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor | None,
    max_spec_len: int,
    uniform_probs_ptr: torch.Tensor | None = None,
    synthetic_conditional_rates_ptr: torch.Tensor | None = None,
    SYNTHETIC_MODE: bool = False,  # noqa: N803 - the Triton kernel's parameter names
) -> None:
    """``rejection_greedy_sample_kernel``: accept while draft == target argmax;
    the argmax at the first mismatch, the bonus token when all drafts match."""
    if SYNTHETIC_MODE:
        raise NotImplementedError("spyre: synthetic rejection sampling is not supported")
    b = output_token_ids_ptr.shape[0]
    s = int(max_spec_len)
    if b == 0 or draft_token_ids_ptr.numel() == 0:
        counts = torch.zeros(b, dtype=torch.int64, device=output_token_ids_ptr.device)
        rows = torch.ones(b, dtype=torch.bool, device=counts.device)
        if is_greedy_ptr is not None:
            rows = is_greedy_ptr.to(torch.bool)
        empty = counts.new_zeros((b, s))
        _write(output_token_ids_ptr, rows, counts, counts, empty, empty, bonus_token_ids_ptr)
        return
    counts, idx, valid = _padded(cu_num_draft_tokens_ptr, s)
    idx = idx.clamp(max=draft_token_ids_ptr.numel() - 1)
    draft = draft_token_ids_ptr.to(torch.int64)[idx]
    target = target_argmax_ptr.to(torch.int64)[idx]
    n_acc = _accepted_len((draft == target) & valid)
    rows = torch.ones(b, dtype=torch.bool, device=counts.device)
    if is_greedy_ptr is not None:
        rows = is_greedy_ptr.to(torch.bool)
    # accepted positions hold draft == target: writing the target serves both
    _write(output_token_ids_ptr, rows, counts, n_acc, target, target, bonus_token_ids_ptr)


def rejection_random_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    recovered_token_ids_ptr: torch.Tensor,
    uniform_probs_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor,
    max_spec_len: int,
    vocab_size: int,
    synthetic_conditional_rates_ptr: torch.Tensor | None = None,
    NO_DRAFT_PROBS: bool = False,  # noqa: N803
    SYNTHETIC_MODE: bool = False,  # noqa: N803
) -> None:
    """``rejection_random_sample_kernel`` for the non-greedy requests: accept
    draft d while ``p_target(d) / p_draft(d) >= u`` (and d >= 0, p_draft(d) > 0);
    the recovered token at the first rejection; the bonus token when none."""
    if SYNTHETIC_MODE:
        raise NotImplementedError("spyre: synthetic rejection sampling is not supported")
    b = output_token_ids_ptr.shape[0]
    s = int(max_spec_len)
    rows = ~is_greedy_ptr.to(torch.bool)
    num_tokens = draft_token_ids_ptr.numel()
    if num_tokens == 0:
        counts = torch.zeros(b, dtype=torch.int64, device=output_token_ids_ptr.device)
        empty = counts.new_zeros((b, s))
        _write(output_token_ids_ptr, rows, counts, counts, empty, empty, bonus_token_ids_ptr)
        return
    counts, idx, valid = _padded(cu_num_draft_tokens_ptr, s)
    idx = idx.clamp(max=num_tokens - 1)
    draft = draft_token_ids_ptr.to(torch.int64)[idx]  # [B, S]
    col = draft.clamp(min=0)
    fdt = _prob_dtype(target_probs_ptr.device)
    target_p = target_probs_ptr.reshape(num_tokens, -1)[idx, col].to(fdt)
    if NO_DRAFT_PROBS or draft_probs_ptr is None:
        draft_p = torch.ones_like(target_p)
    else:
        draft_p = draft_probs_ptr.reshape(num_tokens, -1)[idx, col].to(fdt)
    u = uniform_probs_ptr.to(fdt)[idx]
    safe = torch.where(draft_p > 0, draft_p, torch.ones_like(draft_p))
    accepted = valid & (draft >= 0) & (draft_p > 0) & (target_p / safe >= u)
    n_acc = _accepted_len(accepted)
    recovered = recovered_token_ids_ptr.to(torch.int64)[idx]
    _write(output_token_ids_ptr, rows, counts, n_acc, draft, recovered, bonus_token_ids_ptr)


def expand(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803
) -> None:
    """``expand_kernel``: token t of request r gets ``input[r]``, with
    ``replace_from`` replaced by ``replace_to``."""
    n = output_ptr.numel()
    if n == 0:
        return
    req = _req_of_token(cu_num_tokens_ptr, n).clamp(max=input_ptr.numel() - 1)
    vals = input_ptr[req]
    vals = torch.where(vals == replace_from, torch.full_like(vals, replace_to), vals)
    # tokens past the last request's end are not written (as the kernel)
    total = cu_num_tokens_ptr[-1:].to(torch.int64)
    t = torch.arange(n, dtype=torch.int64, device=vals.device)
    output_ptr.copy_(torch.where(t < total, vals.to(output_ptr.dtype), output_ptr))


def sample_recovered_tokens(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    inv_q_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int | None = None,  # noqa: N803
    NO_DRAFT_PROBS: bool = False,  # noqa: N803
    USE_FP64_GUMBEL: bool = False,  # noqa: N803
) -> None:
    """``sample_recovered_tokens_kernel``: per draft position, the argmax over
    the vocabulary of ``p * inv_q[request]`` with p = the target probabilities
    without the draft token (n-gram) or ``max(p_target - p_draft, 0)``."""
    n = draft_token_ids_ptr.numel()
    if n == 0:
        return
    v = int(vocab_size)
    target = target_probs_ptr.reshape(n, v)
    if NO_DRAFT_PROBS or draft_probs_ptr is None:
        vocab = torch.arange(v, dtype=torch.int64, device=target.device).unsqueeze(0)
        own = vocab == draft_token_ids_ptr.to(torch.int64).unsqueeze(1)
        prob = torch.where(own, torch.zeros_like(target), target)
    else:
        prob = (target - draft_probs_ptr.reshape(n, v)).clamp(min=0)
    req = _req_of_token(cu_num_draft_tokens_ptr, n).clamp(max=inv_q_ptr.shape[0] - 1)
    inv_q = inv_q_ptr[req]
    score = prob.to(inv_q.dtype) * inv_q
    output_token_ids_ptr.copy_(score.argmax(dim=1).to(output_token_ids_ptr.dtype))


_RS = "vllm.v1.sample.rejection_sampler."
#: vLLM's rejection-sampler Triton kernels -> these (kernels.OVERRIDES)
OVERRIDES = {
    _RS + "rejection_greedy_sample_kernel": rejection_greedy_sample,
    _RS + "rejection_random_sample_kernel": rejection_random_sample,
    _RS + "expand_kernel": expand,
    _RS + "sample_recovered_tokens_kernel": sample_recovered_tokens,
}
