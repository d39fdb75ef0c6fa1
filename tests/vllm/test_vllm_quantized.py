"""fp8 weights served on the card: ``--quantization fp8`` and a compressed-tensors
fp8 checkpoint of a tiny llama, greedy tokens against the same quantised model
on the CPU (transformers)."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torch_spyre

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 70], [200, 3, 44, 17, 90, 120, 2], [7]]


def _generate(llm, prompts, n):
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=n, **GREEDY),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _layer_state(worker) -> dict:
    from torch_spyre.vllm_plugin.quantization import SpyreFp8LinearKernel

    model = worker.model_runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    kernels = []
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        qm, scheme = layer.quant_method, getattr(layer, "scheme", None)
        k = getattr(qm, "fp8_linear", None) or getattr(scheme, "linear_kernel", None)
        kernels.append(isinstance(k, SpyreFp8LinearKernel))
    q = attn.qkv_proj
    return {
        "method": type(q.quant_method).__name__,
        "weight": (q.weight.dtype, q.weight.device.type, tuple(q.weight.shape)),
        "scale": tuple(q.weight_scale.shape),
        "spyre_kernels": kernels,
    }


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _tiny(dtype: torch.dtype, **changes) -> LlamaForCausalLM:
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,  # spread logits: no greedy near-ties
    )
    return LlamaForCausalLM(LlamaConfig(**{**sizes, **changes})).eval().to(dtype)


def _per_tensor_fp8(model: LlamaForCausalLM) -> None:
    """vLLM's online fp8 on the CPU: one fp32 scale amax / 448 per *fused* weight
    (q, k, v together; gate and up together), weights quantised and dequantised
    as the card dequantises them: (q.to(fp32) * s).to(model dtype)."""
    for layer in model.model.layers:
        groups = [
            [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            [layer.self_attn.o_proj],
            [layer.mlp.gate_proj, layer.mlp.up_proj],
            [layer.mlp.down_proj],
        ]
        for mods in groups:
            amax = max(m.weight.detach().abs().max() for m in mods)
            s = (amax.to(torch.float32) / torch.tensor(448.0)).reshape(1)
            for m in mods:
                q = torch.ops.spyre.quantize(m.weight.detach(), s, torch.float8_e4m3fn)
                m.weight.data = (q.to(torch.float32) * s).to(m.weight.dtype)


@pytest.fixture(scope="module")
def fp16_llama_dir(tmp_path_factory) -> str:
    # head_dim 64: one fp16 stick, which the compiled path reads whole
    path = tmp_path_factory.mktemp("llama_fp16")
    _tiny(torch.float16, hidden_size=256, intermediate_size=512).save_pretrained(path)
    return str(path)


@pytest.mark.slow  # an LLM engine and two compiled buckets (~30-60 s on 2 cores)
def test_quantization_fp8_serves_fp8_weights_and_matches_the_cpu(fp16_llama_dir, hf_greedy):
    from vllm import LLM

    llm = LLM(
        model=fp16_llama_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        quantization="fp8",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=8 << 20,
        seed=0,
    )
    try:
        torch_spyre.reset_fallback_counts()
        got = _generate(llm, PROMPTS, 8)
        assert torch_spyre.fallback_counts() == {}
        state = llm.collective_rpc(_layer_state)[0]
    finally:
        _close(llm)
    assert state["method"] == "Fp8PerTensorOnlineLinearMethod"
    assert state["weight"] == (torch.float8_e4m3fn, "spyre", (512, 256))  # [q; k; v]
    assert state["scale"] == (1,) and all(state["spyre_kernels"])
    ref = LlamaForCausalLM.from_pretrained(fp16_llama_dir, dtype=torch.float16).eval()
    _per_tensor_fp8(ref)
    ref = ref.float()  # fp16-valued weights, fp32 arithmetic on the CPU
    for p, g in zip(PROMPTS, got):
        assert g == hf_greedy(ref, p, 8), p


@pytest.fixture(scope="module")
def ct_fp8_dir(tmp_path_factory) -> str:
    pytest.importorskip("compressed_tensors")
    from torch_spyre.models import quantized

    path = tmp_path_factory.mktemp("llama_ct_fp8")
    quantized.save_compressed_tensors(_tiny(torch.float32), path, torch.float8_e4m3fn, "channel")
    return str(path)


@pytest.mark.slow  # an LLM engine, eager layers (~15-25 s)
def test_compressed_tensors_fp8_checkpoint_serves_and_matches_transformers(
    ct_fp8_dir, hf_greedy, spyre_settings
):
    from vllm import LLM

    spyre_settings(vllm_compile=False)  # the compiled path: the test above
    llm = LLM(
        model=ct_fp8_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=8 << 20,
        seed=0,
    )
    try:
        torch_spyre.reset_fallback_counts()
        got = _generate(llm, PROMPTS, 8)
        assert torch_spyre.fallback_counts() == {}
        state = llm.collective_rpc(_layer_state)[0]
    finally:
        _close(llm)
    assert state["method"] == "CompressedTensorsLinearMethod"
    assert state["weight"] == (torch.float8_e4m3fn, "spyre", (256, 128))
    assert state["scale"] == (256,) and all(state["spyre_kernels"])  # one per channel
    # the CPU reference: transformers dequantises the checkpoint's weights
    ref = LlamaForCausalLM.from_pretrained(ct_fp8_dir, dtype=torch.float32).eval()
    for p, g in zip(PROMPTS, got):
        assert g == hf_greedy(ref, p, 8), p


def test_fp8_kernel_registrations():
    """The two registrations past vLLM's public surface (vllm_plugin/quantization.py):
    fail here when vLLM renames what they rely on."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTensorSym,
        kFp8StaticChannelSym,
    )
    from vllm.platforms import PlatformEnum, current_platform

    from torch_spyre.vllm_plugin import kernels, quantization

    quantization.register()
    kernels.register_c_ops()
    if current_platform._enum != PlatformEnum.OOT:
        pytest.skip("spyre is not vLLM's platform in this process")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # the kernel builds a CustomOp
        k = linear.init_wfp8_a16_linear_kernel(
            weight_quant_key=kFp8StaticChannelSym,
            activation_quant_key=kFp8DynamicTensorSym,
            weight_shape=(64, 32),
            input_dtype=torch.float16,
            out_dtype=torch.float16,
        )
    assert isinstance(k, quantization.SpyreFp8LinearKernel)
    x = torch.randn(8, 32, dtype=torch.float16) * 50
    out = torch.empty(8, 32, dtype=torch.float8_e4m3fn)
    s = torch.tensor([0.25])
    torch.ops._C.static_scaled_fp8_quant(out, x, s, None)
    want = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
