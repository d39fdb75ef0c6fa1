"""Random-weight tiny models of each adapted architecture: spyre matches the CPU.

Equivalence against the CPU does not need trained weights (shared/models.md),
so each architecture is built from its transformers config class with small
sizes.  The forward must not use the host fallback at all.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402  (the models extra; CI installs it)
from tiny import TINY_DECODER  # noqa: E402

import torch_spyre  # noqa: E402
import torch_spyre.models as models  # noqa: E402
from torch_spyre import validation  # noqa: E402
from torch_spyre.models.patches import TabulatedRotaryEmbedding  # noqa: E402
from torch_spyre.testing import tolerances  # noqa: E402

_DECODER = TINY_DECODER

CAUSAL_LMS = {
    "llama": lambda: transformers.LlamaConfig(**_DECODER),
    "granite": lambda: transformers.GraniteConfig(
        **_DECODER, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0
    ),
    "qwen3": lambda: transformers.Qwen3Config(**_DECODER, head_dim=16),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_DECODER,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}

ENCODERS = {
    "bert": lambda: transformers.BertConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    ),
    "mpnet": lambda: transformers.MPNetConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    ),
}


def _pair(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an adapted architecture must not warn
        dev = models.prepare(copy.deepcopy(model))
    return model, dev


def _prompts(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", sorted(CAUSAL_LMS))
def test_causal_lm_matches_cpu(arch: str) -> None:
    torch.manual_seed(0)
    ref, dev = _pair(transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS[arch]()))
    assert any(isinstance(m, TabulatedRotaryEmbedding) for m in dev.modules())
    report = validation.validate_models(
        ref, dev, kind="causal-lm", inputs=_prompts(1), steps=8, name=f"tiny-{arch}"
    )
    assert report.fallback_counts == {}, report.fallback_counts
    m = report.metrics
    assert m["greedy_identical"] == 1.0, report.format()  # 8 greedy tokens, every prompt
    assert m["top1"] == 1.0, report.format()
    rtol, atol = tolerances(torch.float32).values()
    assert m["max_logit_diff"] <= atol, report.format()
    assert report.passed, report.format()


@pytest.mark.parametrize("arch", sorted(CAUSAL_LMS))
def test_causal_lm_logits_close(arch: str) -> None:
    """One plain forward (no mask, no cache): logits within the fp32 tolerances."""
    torch.manual_seed(0)
    ref, dev = _pair(transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS[arch]()))
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    torch_spyre.reset_fallback_counts()
    with torch.no_grad():
        want = ref(ids).logits
        got = dev(ids.to("spyre")).logits.cpu()
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got, want, **tolerances(torch.float32))


@pytest.mark.parametrize("arch", sorted(ENCODERS))
def test_encoder_matches_cpu(arch: str) -> None:
    torch.manual_seed(0)
    ref, dev = _pair(transformers.AutoModel.from_config(ENCODERS[arch]()))
    batch = _prompts(3)
    batch["attention_mask"] = batch["attention_mask"].flip(-1)  # encoders pad on the right
    report = validation.validate_models(ref, dev, kind="embedding", inputs=batch, name=arch)
    assert report.fallback_counts == {}, report.fallback_counts
    assert report.metrics["pooled_cosine"] >= 0.99999, report.format()
    assert report.passed, report.format()


def test_rotary_table_equals_stock_module() -> None:
    """The host table gives exactly what the stock rotary module computes."""
    cfg = CAUSAL_LMS["gemma3"]()
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    stock = copy.deepcopy(model.model.rotary_emb)
    models.prepare(model, device="cpu")
    table = model.model.rotary_emb
    assert isinstance(table, TabulatedRotaryEmbedding)
    pos = torch.tensor([[0, 5, 17, 127]])
    x = torch.zeros(1)
    for layer_type in ("sliding_attention", "full_attention"):
        for a, b in zip(table(x, pos, layer_type), stock(x, pos, layer_type)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rotary_whose_probe_answers_another_width_is_plain() -> None:
    """dots3's rotary answers the 3-row M-RoPE probe with a table of another
    width: a plain rotary (no sections), not a size error in prepare()."""

    class Rotary(torch.nn.Module):
        def forward(self, x, pos):
            if pos.dim() == 3:  # (3, b, s): one row, of 6 frequencies
                return pos[0, ..., None].float().expand(-1, -1, 6).cos(), None
            ang = pos[..., None].float() * torch.arange(1, 9)
            return ang.cos(), ang.sin()

    table = TabulatedRotaryEmbedding(Rotary(), 32, None)
    assert table.sections is None
    pos = torch.tensor([[0, 3, 31]])
    for a, b in zip(table(torch.zeros(1), pos), Rotary()(torch.zeros(1), pos)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unadapted_architecture_warns_once() -> None:
    cfg = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64, vocab_size=64,
        max_position_embeddings=32, word_embed_proj_dim=32,
    )  # fmt: skip
    models._warned.discard("OPTConfig")
    with pytest.warns(UserWarning, match="no adapter for OPTConfig"):
        models.prepare(transformers.AutoModelForCausalLM.from_config(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.prepare(transformers.AutoModelForCausalLM.from_config(cfg))


def test_adapters_are_found_by_what_the_model_contains() -> None:
    """A config class nobody registered (Qwen2-MoE) still gets its rotary tables
    and the grouped experts kernel, and runs with no host fallback."""
    cfg = transformers.Qwen2MoeConfig(
        **_DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    assert models.adapter_for(cfg) is None
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.warns(UserWarning, match="no adapter for Qwen2MoeConfig"):
        models._warned.discard("Qwen2MoeConfig")
        dev = models.prepare(copy.deepcopy(ref))
    applied = " ".join(dev.spyre_patches)
    assert "tabulate_rotary" in applied and "Qwen2MoeExperts" in applied
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    torch_spyre.reset_fallback_counts()
    with torch.no_grad():
        got = dev(ids.to("spyre")).logits.cpu()
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got, ref(ids).logits, **tolerances(torch.float32))


def test_registry_covers_required_architectures() -> None:
    for cls in (
        transformers.LlamaConfig,
        transformers.GraniteConfig,
        transformers.Qwen3Config,
        transformers.Gemma3TextConfig,
        transformers.BertConfig,
        transformers.MPNetConfig,
        transformers.MixtralConfig,
        transformers.GraniteMoeHybridConfig,
        transformers.DeepseekV3Config,
        transformers.T5Config,
    ):
        assert models.adapter_for(cls()) is not None, cls.__name__

    class MyLlamaConfig(transformers.LlamaConfig):
        pass

    assert models.adapter_for(MyLlamaConfig()).name == "llama"  # the MRO is walked


def test_rotary_positions_past_the_table_raise() -> None:
    model = transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS["llama"]())
    models.prepare(model, device="cpu", max_positions=16)
    with pytest.raises(IndexError, match="max_positions"), torch.no_grad():
        model(torch.zeros(1, 20, dtype=torch.long))


def test_compile_is_off_by_default() -> None:
    model = transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS["llama"]())
    forward = model.forward
    models.prepare(model, device="cpu")
    assert model.forward == forward  # the compiled path is opt-in until the compiler lands


def test_lm_head_split_when_too_large_for_one_kernel() -> None:
    """An lm_head over the kernel size limit runs as vocabulary chunks, same logits."""
    from torch_spyre.models.patches import ChunkedLinear

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(CAUSAL_LMS["gemma3"]()).eval()
    # 256 x 64 fp32 = 64 KiB; a 20 KiB limit gives 4 chunks of 64 rows
    dev = models.prepare(copy.deepcopy(ref), max_linear_bytes=20 * 1024)
    head = dev.get_output_embeddings()
    assert isinstance(head, ChunkedLinear) and head.n_chunks == 4 and head.rows == 64
    assert head.weight is dev.get_input_embeddings().weight  # still tied
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    torch_spyre.reset_fallback_counts()
    with torch.no_grad():
        got = dev(ids.to("spyre")).logits.cpu()
        want = ref(ids).logits
    assert torch_spyre.fallback_counts() == {}
    torch.testing.assert_close(got, want, **tolerances(torch.float32))
    # the default limit (half a core's 256 MiB span) leaves small heads alone
    assert not isinstance(models.prepare(copy.deepcopy(ref)).lm_head, ChunkedLinear)


def test_multimodal_rotary_table_takes_each_frequency_from_its_row():
    """M-RoPE (Qwen3.5): position ids are (3, batch, seq), one row each for
    time, height and width, and each frequency takes its angle from one row.
    The table is probed for that map; looked up with rows that differ (an
    image's grid), it equals the original, and text-only (2-D) ids too."""
    from torch_spyre.tools.archsweep.configs import tiny_config

    cfg = tiny_config("qwen3_5_text")
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    (rope,) = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    table = TabulatedRotaryEmbedding(rope, 64, None)
    assert table.sections is not None and len(set(table.sections.tolist())) > 1
    x = torch.zeros(1)
    g = torch.Generator().manual_seed(0)
    for ids in (torch.randint(0, 64, (3, 2, 5), generator=g), torch.arange(5)[None]):
        want = rope(x, ids)
        got = table.to("spyre")(x.to("spyre"), ids.to("spyre"))
        for w, t in zip(want, got):
            torch.testing.assert_close(t.cpu(), w, rtol=1e-6, atol=1e-6)


def test_a_rotary_of_another_form_is_kept_not_fatal():
    """Llama-4's rotary returns complex frequencies (one value, not a (cos,
    sin) pair) and Beam's keys layer types its rotary does not know: the
    table could not be built and ``prepare`` raised, so neither model ran on
    the card.  Such a rotary is kept as it is (its trig as eager ops)."""
    from types import SimpleNamespace

    from torch_spyre.models.patches import tabulate_rotary

    class ComplexRotaryEmbedding(torch.nn.Module):
        config = SimpleNamespace(max_position_embeddings=16)

        def forward(self, x, position_ids):
            return torch.polar(torch.ones(position_ids.shape), position_ids.float())

    holder = torch.nn.Module()
    holder.rotary = ComplexRotaryEmbedding()
    note = tabulate_rotary(holder, SimpleNamespace(max_positions=16))
    assert isinstance(holder.rotary, ComplexRotaryEmbedding) and "kept" in note
