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


@pytest.mark.slow  # two compiles of a 2-layer model (~30-100 s on 2 cores)
def test_compiled_generation_matches_cpu_and_compiles_once_per_bucket() -> None:
    """prepare(compile=True): a left-padded batch (as validation feeds it), one
    graph for the prefill bucket and one for decoding, however many steps."""
    from torch._dynamo.utils import counters

    from torch_spyre import validation

    torch.manual_seed(0)
    # head_dim 64: whole sticks (a head_dim of 16 needs a re-layout the compiler lacks)
    cfg = transformers.LlamaConfig(**{**_TINY, "hidden_size": 128, "head_dim": 64})
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    dev = models.prepare(copy.deepcopy(ref), compile=True)
    ids = torch.randint(3, 256, (3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :2] = 0
    torch._dynamo.reset()
    counters.clear()
    torch_spyre.reset_fallback_counts()
    # 16 decode steps: no step recompiles or falls back to the host
    got = generate(dev, ids, 17, attention_mask=mask)
    assert len(got.decode_wall_s) == 16
    assert torch_spyre.fallback_counts() == {}
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    want = generate(ref, ids, 17, attention_mask=mask)
    assert torch.equal(got.tokens, want.tokens)
    # HF's own generate on the CPU (dynamic cache, left padding) agrees
    with torch.no_grad():
        hf = ref.generate(ids, attention_mask=mask, max_new_tokens=17, do_sample=False)
    assert torch.equal(hf[:, ids.shape[1] :], want.tokens)
    # and the validation library runs the compiled model through the same loop
    rep = validation.validate_models(
        ref,
        dev,
        kind="causal-lm",
        inputs={"input_ids": ids, "attention_mask": mask},
        steps=6,
        name="tiny-llama",
    )
    assert rep.compiled and rep.passed, rep.format()
    assert rep.metrics["greedy_identical"] == 1.0 and rep.metrics["top1"] == 1.0
