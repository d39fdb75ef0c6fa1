"""The plugin's rotary embeddings against vLLM's reference formulas.

Every variant (neox over the whole head, neox over a partial rotary dim,
GPT-J's interleaved pairs, DeepSeek's YaRN class with position offsets)
equals vLLM's ``forward_native`` exactly on the CPU (the signed-permutation
matmul has one nonzero term per output), and on the card within fp16's
tolerance, compiled included (no host fallback, no strided lane reads).
"""

from __future__ import annotations

import pytest
import torch

from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import tolerances

CASES = [
    # (class, neox, head_size, rotary_dim)
    ("RotaryEmbedding", True, 64, 64),
    ("RotaryEmbedding", True, 64, 32),
    ("RotaryEmbedding", False, 64, 64),
    ("RotaryEmbedding", False, 128, 64),
    ("DeepseekScalingRotaryEmbedding", False, 64, 64),
]


def _rope(cls: str, neox: bool, hd: int, r: int):
    from vllm.config import VllmConfig, set_current_vllm_config

    from torch_spyre.vllm_plugin import layers

    with set_current_vllm_config(VllmConfig()):
        if cls == "RotaryEmbedding":
            return layers.SpyreRotaryEmbedding(hd, r, 256, 10000.0, neox, torch.float32)
        return layers.SpyreDeepseekScalingRotaryEmbedding(
            hd, r, 128, 10000.0, neox, 2.0, torch.float32, mscale=1.0, mscale_all_dim=0.8
        )


def _inputs(hd: int):
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 200, (9,), generator=g)
    return pos, torch.randn(9, 4 * hd, generator=g), torch.randn(9, 2 * hd, generator=g)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rotation_equals_vllms_reference_exactly(case):
    rope = _rope(*case)
    pos, q, k = _inputs(case[2])
    if case[0] == "DeepseekScalingRotaryEmbedding":
        off = torch.full_like(pos, 3)
        want = rope.forward_native(pos, q.view(9, 4, -1), k.view(9, 2, -1), off)
        got = rope.forward_oot(pos, q.view(9, 4, -1), k.view(9, 2, -1), off)
    else:
        want, got = rope.forward_native(pos, q, k), rope.forward_oot(pos, q, k)
    for w, o in zip(want, got):
        assert torch.equal(w, o)


@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_rotation_on_the_card_compiled(case):
    rope = _rope(*case)
    rope.spyre_prepare()
    want = rope.forward_native(*_inputs(case[2]))
    rope = rope.half().to("spyre")
    pos, q, k = _inputs(case[2])
    torch._dynamo.reset()
    fn = torch.compile(rope.forward_oot, fullgraph=True, dynamic=False)
    dispatch_stats.reset("fallback")
    got = fn(pos.to("spyre"), q.half().to("spyre"), k.half().to("spyre"))
    assert dispatch_stats.counts("fallback") == {}
    for w, o in zip(want, got):
        torch.testing.assert_close(o.cpu(), w.half(), **tolerances(torch.float16))
