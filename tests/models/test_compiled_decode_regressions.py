"""Compiled decode regressions.

The two mixture-of-experts models reported to compile to wrong tokens
(issue #26): an OLMoE-style router without top-k renormalisation (64 experts,
top-8) and a Granite MoE with a shared expert, at the reported size (hidden
256, 2 layers).  fp32 on the card, compiled, decoded through a static cache
and compared step by step with the CPU (teacher forcing: each step sees the
CPU's context, so a drifting decode graph shows at the step it drifts), with
no degraded node and no host fallback.
"""

from __future__ import annotations

import pytest
import torch
import transformers as t

from torch_spyre import settings
from torch_spyre.tools.archsweep import run

_BASE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
)

CASES = {
    "olmoe-no-renorm-64x8": lambda: t.OlmoeConfig(
        **_BASE, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False
    ),
    "granitemoeshared": lambda: t.GraniteMoeSharedConfig(
        **_BASE,
        num_local_experts=8,
        num_experts_per_tok=2,
        shared_intermediate_size=512,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_moe_compiled_decode_matches_the_cpu_in_fp32(name):
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(CASES[name](), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(1))
    ref = run.reference(model, ids)
    assert ref.mode == "decode"
    with settings.override(compile_fallback="error"):
        torch._dynamo.reset()
        res = run.run_path(model, ref, ids, compile=True)
        torch._dynamo.reset()
    assert res.verdict == "match", (res.error, res.max_diff, res.scale)
    assert res.token_flips == 0
    assert res.host_fallbacks == 0 and not res.degraded


def _compiled_sweep_type(model_type: str) -> run.PathResult:
    """The architecture sweep's compiled run of one model type (its tiny
    config, decoded against the CPU as the sweep does)."""
    from torch_spyre.tools.archsweep.configs import model_types

    mt = {m.name: m for m in model_types()}[model_type]
    model = run.build(mt)
    ids = run._inputs(model)
    ref = run.reference(model, ids)
    torch._dynamo.reset()
    res = run.run_path(model, ref, ids, compile=True)
    torch._dynamo.reset()
    return res


#: the op whose groups the planner is made to refuse, so that the pattern each
#: model was found with still runs as eager nodes (the planner serves them all
#: now: interleaved rotary stores are lane steps, constant masks fold, ...)
REFUSE = {
    "cohere": "index_put_", "helium": "index_put_", "phimoe": "max", "minimax": "mean",
    "inkling2_text": None,
}  # fmt: skip


#: with every group holding the KV-cache write refused, cohere and helium
#: decoded off by 6.3e-3: the write's position buffer (a pointwise [1] value
#: Inductor tracked to no FX node, realized once per cache) was taken for the
#: iota among its origins.  A guessed node must now read every graph input
#: the buffer reads (``eager_nodes._reads_covered``); these buffers have
#: none, so they run on the host from their IR (4 nodes), and the tokens match
#: host nodes over both graphs, 2 each: the prefill writes the static cache as a
#: graph input too, as the decode step does (it is allocated before the prefill,
#: models/layer_regions.allocate; before, the prefill graph created it).  Each
#: graph had 4 while Inductor also re-laid the written cache to its FX strides
#: (a copy, written back after the write, and its own position buffer); the
#: tensor ``spyre::index_put_`` writes is no longer constrained
#: (``compiler/implicit_fallbacks``)
HOST_NODES = {"cohere": 4, "helium": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    sorted(REFUSE),
)
def test_degraded_rotary_decodes_like_the_cpu(model_type, monkeypatch):
    """Interleaved rotary that the planner cannot express runs as eager kernels
    inside the compiled graph (compiler/eager_nodes.py).  Found by the
    architecture sweep: cohere's rotated key is the value of the KV-cache
    write (a buffer with no origin node: its FX root had to be found among its
    origins, and the write run on a copy), and helium's rotated query is read
    by the attention that Inductor also lists among the buffer's origins (the
    attention had been taken for the root: a silent wrong answer in decode).
    phimoe's router scatters -inf at the first expert's index and takes the
    max again: the scatter is a buffer written into a copy of its input (held
    under the copy's name, which holds the input until the scatter runs), and
    the index is one output of ``max.dim`` (a tuple-valued FX node whose
    buffer is one ``getitem`` of it; read as the tuple it indexed row 1 and
    gave an expert index out of range).  MiniMax and Inkling: Inductor lowers
    ``mean`` to a sum (a buffer) divided in its consumers; the sum buffer was
    taken for the mean's value (read as held, or recomputed as the mean): a
    silent wrong answer; it is recomputed as the sum now."""
    from torch._inductor.utils import fresh_cache

    from torch_spyre.compiler.scheduling import SpyreScheduling
    from torch_spyre.kernels.search import Unsupported

    op = REFUSE[model_type]
    if op is not None:
        plan = SpyreScheduling._plan

        def refusing(self, nodes, *args, **kwargs):
            for n in nodes:
                if any(op in str(o.target) for o in n.node.origins or ()):
                    raise Unsupported(f"test refuses {op}")
            return plan(self, nodes, *args, **kwargs)

        monkeypatch.setattr(SpyreScheduling, "_plan", refusing)
    with fresh_cache():  # a graph planned under the refusal stays out of the cache
        res = _compiled_sweep_type(model_type)
    assert res.verdict == "match" and res.max_diff < 1e-6, (res.error, res.max_diff)
    assert res.degraded.get("eager", 0) > 0
    assert res.degraded.get("host", 0) == HOST_NODES.get(model_type, 0), res.degraded


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["falcon_h1", "deepseek_v4"])
def test_sweep_silent_wrong_answers_are_fixed(model_type):
    """The two silent wrong answers the full architecture sweep left.

    Falcon-H1's decode: the Mamba layer's conv state is rewritten in place
    (a graph input mutation); nodes reading its old value ran as eager
    kernels re-run from the graph input, after the wrapper had already
    written the new state (compiler/eager_nodes.py: such reads now run on
    the host from the IR, whose reads Inductor orders).  DeepSeek-V4: the
    compressor's -inf block mask was cat'ed onto the attention mask by lane
    placement, a matmul, and -inf * 0 is NaN (compiler/passes.py:
    may_be_infinite)."""
    res = _compiled_sweep_type(model_type)
    assert res.verdict == "match" and res.max_diff < 1e-5, (res.error, res.max_diff)
    assert res.token_flips == 0
