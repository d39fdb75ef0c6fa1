"""A transformers decoder's layers traced once (models/layer_regions.py).

Each compiled layer is one nested compile region over its own static-cache
tensors: Dynamo traces one layer body per graph and stamps it out for the
others, and the flattened graph gives the flat trace's answer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from torch_spyre import models
from torch_spyre.compiler import regions
from torch_spyre.models import layer_regions
from torch_spyre.models.generate import generate


def _llama(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_compiled_layers_are_traced_once_and_decode_as_the_cpu():
    ref = _llama(4)
    dev = models.prepare(copy.deepcopy(ref), dtype=torch.float32, compile=True)
    assert any("4 LlamaDecoderLayers traced once" in p for p in dev.spyre_patches)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    before = len(regions.flat_stats)
    out = generate(dev, ids, 5, keep_logits=True)
    cpu = generate(ref, ids, 5, keep_logits=True)
    # the prefill graph and the decode graph: 4 layer calls over 1 traced body each
    assert regions.flat_stats[before:] == [(4, 1), (4, 1)]
    assert torch.equal(out.tokens, cpu.tokens)
    for got, want in zip(out.logits, cpu.logits, strict=True):
        # fp32 on both sides: a mismatch is a bug, not rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_marked_layer_runs_eagerly_as_the_original():
    """Outside ``torch.compile`` the region is the same computation: the
    one-layer view writes the static cache as ``StaticLayer.update`` does."""
    ref = _llama(2)
    marked = copy.deepcopy(ref)
    assert layer_regions.mark_layers(marked).startswith("2 ")
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        caches = []
        for model in (ref, marked):
            cache = StaticCache(config=model.config, max_cache_len=16)
            assert layer_regions.allocate(model, cache, 1) == (model is marked)
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            step = model(input_ids=ids[:, :1], cache=cache, use_cache=True).logits
            caches.append((logits, step, cache))
    (a, sa, ca), (b, sb, cb) = caches
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(sb, sa, rtol=0, atol=0)
    for la, lb in zip(ca.layers, cb.layers, strict=True):
        torch.testing.assert_close(lb.keys, la.keys, rtol=0, atol=0)
        torch.testing.assert_close(lb.values, la.values, rtol=0, atol=0)
        assert int(lb.cumulative_length) == int(la.cumulative_length) == 8
    layer_regions.unmark(marked)
    assert type(marked.model.layers[0]) is type(ref.model.layers[0])


@pytest.mark.parametrize("cache_kind", ["dynamic", "lazy static", "none"])
def test_other_caches_take_the_layers_own_forward(cache_kind):
    """A cache the region cannot take (transformers' DynamicCache, a static
    cache not yet allocated) runs the layer's own forward; no cache runs the
    region without one.  Compiled, each gives the CPU's answer."""
    ref = _llama(2)
    dev = models.prepare(copy.deepcopy(ref), dtype=torch.float32, compile=True)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))

    def cache_for(model):
        if cache_kind == "dynamic":
            return DynamicCache(config=model.config)
        if cache_kind == "lazy static":
            return StaticCache(config=model.config, max_cache_len=16)
        return None

    with torch.no_grad():
        want = ref(input_ids=ids, cache=cache_for(ref), use_cache=cache_kind != "none").logits
        got = dev(
            input_ids=ids.to("spyre"), cache=cache_for(dev), use_cache=cache_kind != "none"
        ).logits
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_a_layer_that_asks_its_cache_more_than_update_is_not_marked():
    ref = _llama(2)
    attn = type(ref.model.layers[0].self_attn)

    class Asking(attn):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                    cache=None, **kwargs):  # fmt: skip
            if cache is not None:
                cache.get_seq_length(self.layer_idx)
            return super().forward(
                hidden_states, position_embeddings, attention_mask, cache, **kwargs
            )

    for layer in ref.model.layers:
        layer.self_attn.__class__ = Asking
    assert layer_regions.why_not(ref.model.layers[0]) == (
        "Asking.forward uses its cache's ['get_seq_length']"
    )
    assert layer_regions.mark_layers(ref).startswith("layers not marked: Asking.forward")
    assert type(ref.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert getattr(type(ref.model.layers[0]), "_spyre_layer_of", None) is None


def test_layers_that_differ_are_traced_each_and_still_compile():
    """Layers whose trace differs (here each attention's scaling, a constant
    the trace reads) are distinct bodies, one per layer: more than Dynamo's
    default cap of 8 (or our vLLM regions' 16) must still compile, and
    answer as the unmarked model (CPU, fp32, Dynamo only)."""
    ref = _llama(18)
    for i, layer in enumerate(ref.model.layers):
        layer.self_attn.scaling = 0.125 * (1 + i / 64)
    marked = copy.deepcopy(ref)
    assert layer_regions.mark_layers(marked).startswith("18 ")

    def backend(gm, example_inputs):
        regions.inline_subgraphs(gm)
        return gm.forward

    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    fn = torch.compile(marked.forward, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        got = fn(input_ids=ids, use_cache=False).logits
        want = ref(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_layer_that_writes_another_layers_cache_is_not_marked():
    """HRM's recurrent cycles call the same layers several times a forward,
    each writing ``cache.update(k, v, self.layer_idx + cycle_offset)``.  A
    marked layer's region takes its own cache layer, so every cycle's writes
    landed in one slot: the archsweep's cache (80 rows) overflowed, and a
    cache with room for them (here 256 rows) decoded wrong logits with no
    error (fp32: 2.4e-4 to 1.9e-3 off on logits of ~0.5, the tokens of this
    tiny model still equal).  Such a layer is left unmarked and decodes as
    the CPU (1.3e-7 off)."""
    from torch_spyre.tools.archsweep import configs, run

    (mt,) = [m for m in configs.model_types() if m.name == "hrm_text"]
    ref = run.build(mt).float()
    assert layer_regions.why_not(layer_regions._decoder_layers(ref)[0]) == (
        "HrmTextAttention.forward updates the cache of layer self.layer_idx + cycle_offset, "
        "not self.layer_idx"
    )
    dev = models.prepare(copy.deepcopy(ref), dtype=torch.float32, compile=True)
    assert not any("traced once" in p for p in dev.spyre_patches)
    ids = torch.randint(
        0, ref.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)
    )
    got = generate(dev, ids, 4, keep_logits=True, bucket=256)
    want = generate(ref, ids, 4, keep_logits=True, bucket=256)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_layer_with_two_cache_writers_is_not_marked():
    """LongCat-Flash: two attentions a decoder layer, writing cache layers 2i
    and 2i + 1; one region hands a layer one cache layer."""
    ref = _llama(2)
    for layer in ref.model.layers:
        layer.second_attn = copy.deepcopy(layer.self_attn)
    assert layer_regions.why_not(ref.model.layers[0]) == (
        "2 modules of the layer write the cache, not one"
    )


def test_a_layer_dynamo_cannot_capture_whole_is_traced_on_its_own():
    """A graph break inside a layer (a data-dependent Python number) cannot
    happen inside a region: Dynamo raises.  The first call, which ran nothing
    on the card, unmarks the layers and compiles again; the model decodes as
    the CPU."""
    ref = _llama(2)
    mlp = type(ref.model.layers[0].mlp)

    class Breaking(mlp):
        def forward(self, x):
            n = int((x == x).sum())  # a graph break
            return super().forward(x) * (n / x.numel())

    for layer in ref.model.layers:
        layer.mlp.__class__ = Breaking
    dev = models.prepare(copy.deepcopy(ref), dtype=torch.float32, compile=True)
    assert any("2 LlamaDecoderLayers traced once" in p for p in dev.spyre_patches)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="traced one by one"):
        got = generate(dev, ids, 3, keep_logits=True)
    want = generate(ref, ids, 3, keep_logits=True)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert dev.spyre_patches[-1].startswith("layer_regions: undone")
    assert type(dev.model.layers[0]).__name__ == "LlamaDecoderLayer"
