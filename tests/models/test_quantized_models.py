"""A tiny llama with 8-bit weights on the card: greedy tokens equal the same
quantised model on the CPU, eager and compiled, from a quantised model or from
a compressed-tensors checkpoint built here."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402

import torch_spyre  # noqa: E402
import torch_spyre.models as models  # noqa: E402
from torch_spyre import settings  # noqa: E402
from torch_spyre.models import quantized  # noqa: E402
from torch_spyre.models.generate import generate  # noqa: E402

HAVE_CT = importlib.util.find_spec("compressed_tensors") is not None
# head_dim 32: one fp32 stick, so the compiled path reads heads as whole sticks
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    # logits spread out: greedy near-ties (which no two implementations break
    # alike) are rare
    initializer_range=0.2,
)
IDS = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(4))


def _tiny(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, **changes})
    return transformers.LlamaForCausalLM(cfg).eval()


# head_dim 128: the output projection reads its fp8 weight in pieces of a head,
# whole 128-element fp8 sticks (narrower pieces keep its dequantisation apart)
WIDE_HEADS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                  num_key_value_heads=1)  # fmt: skip


def _check(dev, ref, n: int = 8):
    torch_spyre.reset_fallback_counts()
    got = generate(dev, IDS, n)
    assert torch_spyre.fallback_counts() == {}
    want = generate(ref, IDS, n)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    return got


@pytest.mark.parametrize(
    "dtype, granularity",
    [(torch.float8_e4m3fn, "channel"), (torch.int8, "tensor")],
    ids=["fp8-channel", "int8-tensor"],
)
def test_quantised_tiny_llama_eager_matches_cpu(dtype, granularity):
    ref = quantized.quantize(_tiny(), dtype, granularity)
    dev = models.prepare(copy.deepcopy(ref))
    layer = dev.model.layers[0].mlp.down_proj
    assert isinstance(layer, quantized.QuantizedLinear)
    assert layer.weight.dtype == dtype and layer.weight.device.type == "spyre"
    got = _check(dev, ref)
    # decode is a weight stream: the same model with fp16-sized weights costs more
    fp = models.prepare(_tiny())
    assert generate(fp, IDS, 3).decode_modelled_s[-1] > got.decode_modelled_s[-1]


def test_prepare_keeps_a_quantised_layer_8bit_under_a_dtype_cast():
    dev = models.prepare(quantized.quantize(_tiny()), dtype=torch.float16)
    layer = dev.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert dev.model.embed_tokens.weight.dtype == torch.float16


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ct_fp8")
    quantized.save_compressed_tensors(_tiny(), path, torch.float8_e4m3fn, "channel")
    return str(path)


@pytest.fixture(scope="module")
def ct_wide_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ct_fp8_wide")
    model = _tiny(**WIDE_HEADS)
    quantized.save_compressed_tensors(model, path, torch.float8_e4m3fn, "channel")
    return str(path)


@pytest.mark.skipif(not HAVE_CT, reason="compressed-tensors is not installed (vllm extra)")
def test_compressed_tensors_checkpoint_keeps_8bit_weights_and_matches_transformers(
    ct_checkpoint,
):
    ref = models.load_reference(ct_checkpoint, kind="causal-lm")  # transformers dequantises
    dev = models.load(ct_checkpoint, kind="causal-lm")
    assert any("compressed-tensors" in p for p in dev.spyre_patches)
    layer = dev.model.layers[1].self_attn.o_proj
    assert isinstance(layer, quantized.QuantizedLinear)
    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight_scale.shape) == (128,)
    _check(dev, ref)


@pytest.mark.slow  # a compiled 2-layer model (~20-40 s on 2 cores)
@pytest.mark.skipif(not HAVE_CT, reason="compressed-tensors is not installed (vllm extra)")
def test_compressed_tensors_checkpoint_compiles_with_no_fallback(ct_wide_checkpoint):
    from torch_spyre.compiler import scheduling

    ref = models.load_reference(ct_wide_checkpoint, kind="causal-lm")
    dev = models.load(ct_wide_checkpoint, kind="causal-lm", compile=True)
    weights = {
        tuple(m.weight.shape) for m in dev.modules() if isinstance(m, quantized.QuantizedLinear)
    }
    torch._dynamo.reset()
    scheduling.PLANS.clear()
    # plan, do not replay: neither Inductor's graph cache nor a precompiled
    # forward (saved by an earlier run: its key names the checkpoint's path,
    # which a fresh /tmp hands out again) stands in for the compile.  The plain
    # torch.compile path: inside the whole suite the ahead-of-time compile
    # built both graphs and still recorded no plan here (stop 48, cause not
    # found); test_precompiled.py checks that path gives the same modelled times
    with torch._inductor.config.patch(fx_graph_cache=False), settings.override(precompile=False):
        _check(dev, ref)
    progs = [p.program for p in scheduling.PLANS]
    # every projection reads its fp8 weight in its matmul program
    fp8_mm = [
        p
        for p in progs
        if any(o.layout.dtype == torch.float8_e4m3fn for o in p.operands)
        and any(type(s).__name__ == "Matmul" for s in p.steps)
    ]
    # q, k, v, o, gate, up, down per layer (decode and prefill)
    assert len(fp8_mm) >= 7 * 2, (len(progs), sorted(weights))
    # no dequantised (16/32-bit) weight is written to device memory
    for p in progs:
        for o in p.operands:
            assert not (o.role == "output" and tuple(o.layout.host_size) in weights), p.name
