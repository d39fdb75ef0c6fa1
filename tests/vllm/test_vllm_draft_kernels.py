"""The model-based drafters' input kernels in torch ops (vllm_plugin/draft_kernels.py)
equal a loop transcription of vLLM's Triton kernels (vllm/v1/spec_decode/utils.py),
one program (request) at a time, and are what vLLM launches."""

from __future__ import annotations

import pytest
import torch

from torch_spyre.vllm_plugin import draft_kernels as dk

PAD = -1


# -- loop transcriptions of vLLM's kernels -------------------------------------------
def _ref_step(pos, table, seq, out_pos, out_slot, bs, max_len, n_blocks, b, input_b):
    for r in range(input_b):
        if r >= b:
            out_slot[r] = PAD
            continue
        p = int(pos[r]) + 1
        exceeds = p >= max_len
        c = 0 if exceeds else p
        blk = min(c // bs, n_blocks - 1)
        slot = int(table[r, blk]) * bs + c % bs
        out_pos[r] = c
        out_slot[r] = PAD if exceeds else slot
        seq[r] = min(1 if exceeds else int(seq[r]) + 1, max_len)


def _ref_inputs_padded(cu, valid, qsl, out_idx, out_rej, n):
    for r in range(n):
        drafts = int(cu[r]) - (int(cu[r - 1]) if r else 0)
        rej = drafts + 1 - int(valid[r]) if drafts > 0 else 0
        out_idx[r] = int(qsl[r + 1]) - 1 - rej
        out_rej[r] = rej


def _ref_next_token(sampled, discard, backup, nxt, count, vocab, w, n):
    for r in range(n):
        if bool(discard[r]):
            nxt[r], count[r] = int(backup[r]), 0
            continue
        row = [int(t) for t in sampled[r, :w]]
        ok = [i for i, t in enumerate(row) if t != -1 and t < vocab]
        nxt[r] = row[ok[-1]] if ok else int(backup[r])
        count[r] = len(ok)


def _ref_expand(tgt, tpos, nxt, o_ids, o_pos, o_rej, o_mask, o_new, o_map, qsl, qel, pad_id,
                par_id, total, p, shift):  # fmt: skip
    for r in range(qel.shape[0]):
        qs, nqs, qe = int(qsl[r]), int(qsl[r + 1]), int(qel[r])
        if shift:
            nv, off, start = qe - qs, 1, qs + r * (p - 1)
        else:
            nv, off, start = qe - qs + 1, 0, qs + r * p
        n_out = nv + p + (nqs - qe - 1)
        for j in range(n_out):
            o = start + j
            if j < nv:
                t = int(tgt[min(qs + off + j, total - 1)])
            elif j == nv:
                t = int(nxt[r])
            elif j < nv + p:
                t = par_id
            else:
                t = pad_id
            rejected = j >= nv + p
            o_ids[o] = t
            o_pos[o] = 0 if rejected else int(tpos[qs]) + j
            o_rej[o] = rejected
            o_mask[o] = nv < j < nv + p
            if nv <= j < nv + p:
                o_new[r * p + j - nv] = o
        if shift:
            for j in range(nqs - qs):
                o_map[qs + j] = start + j


# -- cases ------------------------------------------------------------------------------
def _batch(g: torch.Generator, b: int, k: int):
    """b requests of 1..k+1 scheduled tokens (a decode with up to k drafts,
    or a prefill chunk), with rejected drafts at the end of some."""
    q = torch.randint(1, k + 2, (b,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)]).to(torch.int32)
    rejected = torch.minimum(torch.randint(0, k + 1, (b,), generator=g), q - 1)
    qel = (qsl[1:] - 1 - rejected).to(torch.int32)
    return qsl, qel


@pytest.mark.parametrize("seed", range(6))
def test_step_slot_mapping_equals_vllm_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, input_b, bs, n_blocks, max_len = 5, 8, 4, 6, 24
    pos = torch.randint(0, max_len, (b,), generator=g)
    pos[0] = max_len - 1  # one request steps past the end
    table = torch.randint(0, 50, (b, n_blocks), generator=g).to(torch.int32)
    seq = (pos + 1).to(torch.int32)
    want = [t.clone() for t in (seq, torch.zeros(b, dtype=torch.int64), torch.zeros(input_b, dtype=torch.int64))]  # fmt: skip
    _ref_step(pos, table, want[0], want[1], want[2], bs, max_len, n_blocks, b, input_b)
    got = [seq.clone(), torch.zeros(b, dtype=torch.int64), torch.zeros(input_b, dtype=torch.int64)]
    dk.eagle_step_slot_mapping_metadata(
        pos, table, n_blocks, got[0], got[1], got[2], bs, max_len, n_blocks, PAD, b
    )
    for w, x in zip(want, got):
        assert torch.equal(w, x)
    assert int(got[2][0]) == PAD and int(got[0][0]) == 1


@pytest.mark.parametrize("seed", range(6))
def test_prepare_inputs_padded_equals_vllm_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, k = 6, 3
    drafts = torch.randint(0, k + 1, (n,), generator=g)
    cu = drafts.cumsum(0).to(torch.int32)
    valid = (torch.randint(0, k + 1, (n,), generator=g).clamp(max=drafts) + 1).to(torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), (drafts + 1).cumsum(0)]).to(torch.int32)
    want = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
    _ref_inputs_padded(cu, valid, qsl, want[0], want[1], n)
    got = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
    dk.eagle_prepare_inputs_padded(cu, valid, qsl, got[0], got[1], n)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert bool((want[1] > 0).any())  # the cases reject some drafts


@pytest.mark.parametrize("seed", range(6))
def test_prepare_next_token_padded_equals_vllm_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, w, vocab = 6, 4, 50
    sampled = torch.randint(0, vocab + 5, (n, w), generator=g).to(torch.int32)
    cut = torch.randint(0, w + 1, (n,), generator=g)
    sampled[torch.arange(w).unsqueeze(0) >= cut.unsqueeze(1)] = -1  # rejected: -1
    discard = torch.rand(n, generator=g) < 0.3
    backup = torch.randint(0, vocab, (n,), generator=g).to(torch.int32)
    want = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
    _ref_next_token(sampled, discard, backup, want[0], want[1], vocab, w, n)
    got = [torch.zeros(n, dtype=torch.int32) for _ in range(2)]
    dk.eagle_prepare_next_token_padded(
        sampled, discard, backup, got[0], got[1], vocab, w, n, w, BLOCK_SIZE_TOKENS=4
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("shift", [False, True])  # draft model / EAGLE
@pytest.mark.parametrize("seed", range(6))
def test_copy_and_expand_equals_vllm_loop(seed, shift):
    g = torch.Generator().manual_seed(seed)
    b, k, size = 4, 3, 64
    p = 1  # one bonus slot per request (draft models; EAGLE nets 0 new slots)
    qsl, qel = _batch(g, b, k)
    total = int(qsl[-1])
    tgt = torch.randint(0, 100, (total,), generator=g).to(torch.int32)
    tpos = torch.randint(0, 30, (total,), generator=g)
    nxt = torch.randint(100, 200, (b,), generator=g).to(torch.int32)

    def bufs():
        return [
            torch.full((size,), -7, dtype=torch.int32),
            torch.full((size,), -7, dtype=torch.int64),
            torch.zeros(size, dtype=torch.bool),
            torch.ones(size, dtype=torch.bool),
            torch.full((b * p,), -7, dtype=torch.int32),
            torch.full((total,), -7, dtype=torch.int32),
        ]

    want, got = bufs(), bufs()
    _ref_expand(tgt, tpos, nxt, *want, qsl, qel, 0, 0, total, p, shift)
    dk.copy_and_expand_eagle_inputs(
        tgt, tpos, nxt, *got, qsl, qel, 0, 0, total, p, shift, BLOCK_SIZE_TOKENS=8
    )
    for i, (w, x) in enumerate(zip(want, got)):
        assert torch.equal(w, x), (i, w, x)
    assert bool(want[2].any())  # the cases have rejected slots


def test_overrides_are_registered_for_vllms_drafter():
    """The overrides reach the kernels vLLM's proposer launches (vLLM's public
    register_kernels hook); fails if vLLM renames or moves one."""
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode import utils

    current_platform.register_triton_kernel_overrides()
    for name, impl in dk.OVERRIDES.items():
        kernel = getattr(utils, name.rsplit(".", 1)[1])
        assert getattr(kernel, "func", None) is impl, name
