"""The static-KV-cache generation loop on spyre matches the CPU and transformers' generate()."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402  (the models extra; CI installs it)
from tiny import TINY_DECODER  # noqa: E402

import torch_spyre  # noqa: E402
import torch_spyre.models as models  # noqa: E402
from torch_spyre.models.generate import generate  # noqa: E402

_TINY = TINY_DECODER
CAUSAL_LMS = {
    "llama": lambda: transformers.LlamaConfig(**_TINY),
    # sliding-window layers get a sliding static cache layer
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_TINY, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    ),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_cache_generation_matches_cpu(arch: str) -> None:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS[arch]()).eval()
    dev = models.prepare(copy.deepcopy(ref))
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    torch_spyre.reset_fallback_counts()
    got = generate(dev, ids, 8)
    assert torch_spyre.fallback_counts() == {}
    want = generate(ref, ids, 8)
    assert torch.equal(got.tokens, want.tokens)
    with torch.no_grad():
        hf = ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )
    assert torch.equal(hf[:, ids.shape[1] :], want.tokens)
    # the cache lives in device memory and has one bucketed shape
    assert got.cache_len == 64 and len(got.decode_modelled_s) == 7
    assert got.prefill_modelled_s > 0 and all(t > 0 for t in got.decode_modelled_s)
    # sampling is seeded on the host: same tokens on both sides
    a = generate(dev, ids, 8, do_sample=True, temperature=0.8, seed=3)
    b = generate(ref, ids, 8, do_sample=True, temperature=0.8, seed=3)
    assert torch.equal(a.tokens, b.tokens)
