"""Estimates for models too large to run here: planned by the real compiler, timed, not computed.

``spyre estimate granite-3.3-8b`` builds the model from its public config
values (``MODELS``: the Hugging Face ``config.json`` of each checkpoint) with
the transformers config class, on the meta device (no weights), and plans it
for the card through the real path: plain ``torch.compile`` (the spyre
Inductor backend) of the stock transformers decoder layer, patched by the
model's adapter (``torch_spyre.models.REGISTRY``).  The planned kernel
programs then run inside ``torch_spyre.sim.timing_only()``: they are
validated and timed by the simulator's timing model, launched through the
runtime as in a real run, but their values are not computed (an 8B model's
prefill is ~16 TFLOP: hours for the functional executor on two host cores).

What is planned and how it adds up:

* Every decoder layer of these models has the same shapes, so one layer per
  *layer kind* is planned (Gemma-3: sliding-window and global attention
  layers are two kinds; Granite and Qwen3: one) and its modelled time is
  multiplied by the number of layers of that kind.
* Prefill (``prompt`` tokens, batch 1): embedding lookup and rotary tables,
  each layer (causal attention over the prompt, keys and values written into
  the KV cache), final norm and LM head on the last position (the logits
  generation needs).
* Decode (one token at position ``prompt``): the same, each layer attending
  over its static KV cache (``cache_len`` positions for global layers,
  ``min(sliding_window, cache_len)`` for sliding ones, a ring buffer).
* The parts are compiled and run once to compile and warm up, then once
  more with the simulator's trace listening: a part's modelled time is the
  sum of the kernel programs (and device copies) recorded during that call.

The outer glue (embedding scale, final norm, LM head on the last position,
logit scaling) is written out here after each architecture's ``forward``:
compiling the whole stock model with a static cache does not plan yet (see
docs/compiler.md), the decoder layer does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_spyre.models import parallel
from torch_spyre.models.estimate_results import Estimate, KernelPlan, Part

# --------------------------------------------------------------------- the models
#: Public config values of the real checkpoints (their Hugging Face config.json).
MODELS: dict[str, dict[str, Any]] = {
    "granite-3.3-8b": {
        "source": "ibm-granite/granite-3.3-8b-instruct config.json",
        "config_class": "GraniteConfig",
        "values": dict(
            vocab_size=49159,
            hidden_size=4096,
            intermediate_size=12800,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=10000000.0,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=True,
            attention_multiplier=0.0078125,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            logits_scaling=16.0,
        ),
    },
    "qwen3-8b": {
        "source": "Qwen/Qwen3-8B config.json",
        "config_class": "Qwen3Config",
        "values": dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            hidden_act="silu",
            attention_bias=False,
            tie_word_embeddings=False,
        ),
    },
    "gemma-3-27b": {
        # the language model of the multimodal checkpoint (its text_config); the
        # vision tower (~0.4B) is not part of a text estimate.  25.6B parameters
        # in the decoder layers + 1.41B in the (tied) embedding.
        "source": "google/gemma-3-27b-it config.json (text_config)",
        "config_class": "Gemma3TextConfig",
        "values": dict(
            vocab_size=262208,
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            query_pre_attn_scalar=168,
            sliding_window=1024,
            # sliding_window_pattern 6: five local layers, then one global
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
            ],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"factor": 8.0, "rope_type": "linear"},
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    },
    "gemma-4-26b-a4b": {
        # the language model of google/gemma-4-26B-A4B-it (its text_config; the
        # vision tower is not part of a text estimate).  Checked against IBM's
        # model-op test set (tests/resource/models/gemma-4-26B-A4B-it.yaml in
        # torch-spyre-tests 9e0a3d8): q_proj 4096/8192 x 2816 (16 heads x 256 on
        # sliding, x 512 on full layers), k_proj 2048/1024 (8 x 256 / 2 x 512,
        # no v_proj on full layers: K = V), dense MLP 2112, router [128, 2816],
        # experts gate_up [128, 1408, 2816] and down [128, 2816, 704], 8 routed
        # slots per token, a 1024-position sliding cache, logits soft-capped at 30.
        # 30 layers, 5 sliding then 1 full; no per-layer input embeddings.
        "source": "google/gemma-4-26B-A4B-it config.json (text_config)",
        "config_class": "Gemma4TextConfig",
        "values": dict(
            vocab_size=262144,
            hidden_size=2816,
            intermediate_size=2112,
            num_hidden_layers=30,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            global_head_dim=512,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            sliding_window=1024,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                },
            },
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=262144,
            num_kv_shared_layers=0,
            final_logit_softcapping=30.0,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    },
}
ALIASES = {
    "granite": "granite-3.3-8b",
    "granite-8b": "granite-3.3-8b",
    "qwen3": "qwen3-8b",
    "gemma3-27b": "gemma-3-27b",
    "gemma-27b": "gemma-3-27b",
    "gemma4-26b": "gemma-4-26b-a4b",
    "gemma-4-26b": "gemma-4-26b-a4b",
}


def model_config(name: str, **overrides: Any):
    """The transformers config of ``name`` (a key of ``MODELS`` or an alias)."""
    import transformers

    key = ALIASES.get(name, name)
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[key]
    cls = getattr(transformers, spec["config_class"])
    values = {**spec["values"], **overrides}
    if "num_hidden_layers" in overrides and "layer_types" in spec["values"]:
        values.setdefault("layer_types", spec["values"]["layer_types"])
        values["layer_types"] = values["layer_types"][: overrides["num_hidden_layers"]]
    cfg = cls(**values)
    cfg._attn_implementation = "sdpa"
    return cfg


# ------------------------------------------------------------------ the planning
class _LayerCache:
    """One layer's static KV cache, as a decoder layer's attention sees it.

    ``update`` writes the new keys/values at ``positions`` (in place, in device
    memory: ``index_copy_``, the device's DMA kernel) and returns what the
    attention attends over: the whole static cache (decode, and a prefill
    from position 0 attending causally: ``is_causal`` is top-left aligned, so
    query i sees cache rows 0..i, the rows just written, and the flash
    program skips the key tiles past the diagonal), or the new keys and
    values (a sliding window's prefill mask, over the prompt).  Read from
    the cache, the new K and V have no reader but their write, and the
    projections program stores them into their rows itself
    (``compiler/cache_write_fusion.py``).
    """

    def __init__(self, keys, values, positions, whole: bool):
        self.keys, self.values, self.positions, self.whole = keys, values, positions, whole

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        if self.whole:
            return self.keys, self.values
        return key_states, value_states


def _layer_cfg(cfg, idx: int):
    """Layer ``idx``'s config: its per-layer view for a heterogeneous config
    (Gemma 4: head_dim and KV heads differ on full-attention layers)."""
    return cfg.per_layer_config[idx] if getattr(cfg, "is_heterogeneous", False) else cfg


def _kinds_config(cfg, kinds: list[str], first: dict[str, int]):
    """A copy of ``cfg`` with one layer per kind (``kinds[i]`` is layer i), each
    with the per-layer values of the first real layer of its kind."""
    small = copy.deepcopy(cfg)
    overrides = {}
    if getattr(cfg, "is_heterogeneous", False):
        spec = cfg._heterogeneity_spec.per_layer_overrides
        overrides = {i: dict(spec[first[k]]) for i, k in enumerate(kinds) if spec.get(first[k])}
        small.per_layer_config = None  # keyed by the real model's layer indices
    small.num_hidden_layers = len(kinds)
    if getattr(cfg, "layer_types", None):
        small.layer_types = list(kinds)
    if overrides:
        small.per_layer_config = overrides
    return small


def _experts(layer: nn.Module) -> tuple[int, int]:
    """(parameters in the layer's routed experts, number of experts): the stacked
    expert tensors of transformers' ``@use_experts_implementation`` modules."""
    from torch_spyre.models import moe

    params, num = 0, 0
    for mod in moe.experts_modules(layer):
        for p in mod.parameters(recurse=False):
            params += p.numel()
        num = max(num, getattr(mod, "num_experts", 0) or mod.gate_up_proj.shape[0])
    return params, num


def _top_k(cfg) -> int:
    for name in ("top_k_experts", "num_experts_per_tok", "moe_topk"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"{type(cfg).__name__}: a mixture-of-experts config with no top-k value")


def experts_touched(num: int, top_k: int, batch: int) -> float:
    """Experts a decode step of ``batch`` tokens reads, expected under uniform,
    independent routing: ``num * (1 - (1 - top_k / num) ** batch)`` (``top_k``
    exactly at batch 1, every expert as the batch grows)."""
    return num * (1.0 - (1.0 - top_k / num) ** batch)


def _layer_kinds(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * cfg.num_hidden_layers


def _materialise(module: nn.Module, device: str) -> None:
    """Meta parameters/buffers become uninitialised device memory (never touched
    in timing-only mode), real ones are copied; tied tensors stay tied."""
    memo: dict[int, torch.Tensor] = {}
    keep: list[torch.Tensor] = []  # the originals stay alive: their ids stay unique

    def move(t: torch.Tensor, param: bool) -> torch.Tensor:
        got = memo.get(id(t))
        if got is None:
            keep.append(t)
            got = torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t.to(device)
            if param:
                got = nn.Parameter(got, requires_grad=False)
            memo[id(t)] = got
        return got

    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = move(p, True)  # type: ignore[assignment]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = move(b, False)


class _Recorder:
    """Kernel and transfer records of the simulator's trace during one call."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def __enter__(self) -> _Recorder:
        from torch_spyre.sim import trace

        trace.add_listener(self.records.append)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch_spyre.sim import trace

        trace.remove_listener(self.records.append)


def _run_part(name: str, count: int, fn: Callable[[], Any]) -> tuple[Part, Any]:
    """Call ``fn`` twice (compile + warm, then timed); the part is the second call.

    Returns the part and the second call's output."""
    from torch_spyre.sim import KernelRecord

    with torch.no_grad():
        fn()
        torch.spyre.synchronize()
        before = torch.spyre.memory_allocated()
        torch.spyre.reset_peak_memory_stats()
        clock = torch.spyre.modelled_time_s()
        with _Recorder() as rec:
            out = fn()
        elapsed = torch.spyre.modelled_time_s() - clock
        act = torch.spyre.max_memory_allocated() - before
    part = Part(name, count, 0.0, activation_bytes=max(act, 0))
    for r in rec.records:
        if isinstance(r, KernelRecord):
            part.kernels.append((r.name, r.time_s))
            part.plans.append(KernelPlan.of(r.report))
        elif r.kind == "d2d":
            part.copies_s += r.time_s
        else:
            part.host_transfers += 1
            part.copies_s += r.time_s
    part.time_s = sum(t for _, t in part.kernels) + part.copies_s
    if not math.isclose(part.time_s, elapsed, rel_tol=1e-6, abs_tol=1e-12):
        raise RuntimeError(
            f"estimate {name}: recorded {part.time_s:.6g} s but the card's clock moved "
            f"{elapsed:.6g} s (something ran outside the trace)"
        )
    return part, out


def _matmul_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _linear_rows(module: nn.Module) -> int:
    """Output channels of the quantised linear layers of ``module`` (one scale each)."""
    from torch_spyre.models.quantized import QuantizedLinear

    return sum(m.out_features for m in module.modules() if isinstance(m, QuantizedLinear))


#: vLLM's default ``max_num_batched_tokens`` for ``vllm serve`` on hardware it
#: has no tuned defaults for (``EngineArgs``: 2048 for the API server)
DEFAULT_TOKEN_BUDGET = 2048


def prefill_batch(batch: int, prompt: int, token_budget: int) -> int:
    """Requests of ``prompt`` tokens one prefill step packs: as many whole
    prompts as the budget holds (at least one), rounded down to a divisor of
    ``batch`` so that every step is the same planned step."""
    if token_budget < 1:
        raise ValueError(f"token budget must be at least 1, got {token_budget}")
    fit = max(1, min(batch, token_budget // max(prompt, 1)))
    while batch % fit:
        fit -= 1
    return fit


def estimate(
    name: str,
    *,
    prompt: int = 1024,
    new_tokens: int = 128,
    bucket: int = 64,
    dtype: torch.dtype = torch.float16,
    overrides: dict[str, Any] | None = None,
    config: Any = None,
    timing_only: bool = True,
    weights: torch.dtype | None = None,
    batch: int = 1,
    tp: int = 1,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    spec_tokens: int = 0,
    lora=None,
) -> Estimate:
    """Plan ``name`` for the card and model prefill of ``prompt`` tokens and one
    decode step at position ``prompt`` (static cache of ``prompt + new_tokens``
    positions rounded up to ``bucket``).

    ``overrides``: config values to change (e.g. a tiny test model);
    ``config``: a ready transformers config instead of ``MODELS[name]``;
    ``timing_only=False`` computes the values too (small models only);
    ``weights``: an 8-bit type (``torch.float8_e4m3fn``, ``torch.int8``) for the
    decoder layers' linear weights, one fp32 scale per output channel
    (``models.quantized.QuantizedLinear``: read as 8-bit data, dequantised in
    LX; activations stay ``dtype``); the embedding and LM head stay ``dtype``,
    as the usual fp8 recipes leave them.
    ``batch``: requests per decode step, all at the same position; their
    prefills are packed into steps of at most ``token_budget`` tokens, as
    vLLM's scheduler packs them (``max_num_batched_tokens``; one step of
    ``prefill_batch(...)`` requests planned, counted once per step; a prompt
    longer than the budget is planned whole); ``tp``: cards the
    model is split over as vLLM's parallel layers split it (models/parallel.py;
    the plan is one card's shard plus the collectives).
    ``spec_tokens``: k > 0 also plans a speculative verification step: every
    request's k drafts and its last token (k + 1 query positions at position
    ``prompt``, causal over the cache) in one forward, the LM head on all
    k + 1 rows (``Estimate.verify``; models/spec_estimate.py).
    ``lora`` (``lora_estimate.LoraOptions``): every decode step also runs the
    LoRA programs of N adapters of one rank over its tokens
    (models/lora_estimate.py), and their stacks count in device memory.
    """
    import transformers

    import torch_spyre
    from torch_spyre import models
    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.runtime import cards, dispatch_stats
    from torch_spyre.sim import timing_only as timing_only_mode

    t_wall = time.perf_counter()
    key = ALIASES.get(name, name)
    cfg = config if config is not None else model_config(key, **(overrides or {}))
    cfg._attn_implementation = "sdpa"
    spec = MODELS.get(key, {"source": "given config", "config_class": type(cfg).__name__})
    itemsize = dtype.itemsize
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    whole_cfg = cfg
    cfg = parallel.shard_config(cfg, tp)  # one card's shard (the model itself at tp 1)
    cfg._attn_implementation = "sdpa"
    model_params = parallel.card_weight_bytes(whole_cfg, 1, dtype) // itemsize if tp > 1 else 0

    # the (card's) model on the meta device: exact parameter counts, no weights
    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tied = full.get_output_embeddings().weight is full.get_input_embeddings().weight
    params = sum(p.numel() for p in full.parameters())  # tied weights once
    emb_params = full.get_input_embeddings().weight.numel()
    layer_kinds = _layer_kinds(cfg)
    counts = Counter(layer_kinds)
    kinds = sorted(counts)
    first = {k: layer_kinds.index(k) for k in kinds}
    layer_mm = {k: _matmul_params(full.model.layers[first[k]]) for k in kinds}
    layer_experts = {k: _experts(full.model.layers[first[k]]) for k in kinds}
    expert_params = sum(counts[k] * layer_experts[k][0] for k in kinds)
    num_experts = max(n for _, n in layer_experts.values())
    top_k = _top_k(cfg) if expert_params else 0
    active_params = params - expert_params + (expert_params * top_k // num_experts if top_k else 0)
    lm_head_params = full.get_output_embeddings().weight.numel()
    del full

    # one layer per kind (+ embedding, final norm, LM head), patched by the adapter
    small_cfg = _kinds_config(cfg, kinds, first)
    cache_len = -(-(prompt + new_tokens) // bucket) * bucket
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(small_cfg, dtype=dtype)
    model.eval()
    base = model.model
    # rotary tables are computed on the host (tabulate_rotary): a real module for that
    rot_attr = "rotary_emb"
    with torch.device("cpu"):
        setattr(base, rot_attr, type(getattr(base, rot_attr))(config=small_cfg))
    opts = models.PrepareOptions(max_positions=cache_len)
    adapter = models.adapter_for(small_cfg)
    applied = []
    for patch in adapter.patches if adapter else ():
        what = patch(model, opts)
        if what:
            applied.append(what)
    if weights is not None:
        from torch_spyre.models import quantized

        for layer in base.layers:
            quantized.quantize_meta(layer, weights)
    head = model.get_output_embeddings()
    # the chunked LM head keeps its chunks as copies of the weight (patches.ChunkedLinear)
    extra = sum(b.numel() * b.element_size() for b in model.buffers())
    _materialise(model, "spyre")
    rot = getattr(base, rot_attr)
    head = model.get_output_embeddings()

    hidden = cfg.hidden_size

    def head_shape(kind: str) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim) of the layers of ``kind``."""
        lc = _layer_cfg(cfg, first[kind])
        heads = lc.num_attention_heads
        return heads, lc.num_key_value_heads, getattr(lc, "head_dim", None) or hidden // heads

    heads_of = {k: head_shape(k) for k in kinds}
    window = getattr(cfg, "sliding_window", None)

    def kv_len(kind: str) -> int:
        return min(window, cache_len) if kind == "sliding_attention" and window else cache_len

    emb_mult = getattr(cfg, "embedding_multiplier", None)
    logit_div = getattr(cfg, "logits_scaling", None)
    softcap = getattr(cfg, "final_logit_softcapping", None)

    def embed_step(ids, pos):
        h = base.embed_tokens(ids)
        if emb_mult is not None:
            h = h * emb_mult
        tables = []
        for kind in kinds:
            cs = rot(h, pos, kind) if getattr(rot, "layer_types", None) else rot(h, pos)
            tables.extend(cs)
        return h, *tables

    def head_step(h, rows: int = 1):
        x = base.norm(h[:, -rows:, :])
        # a chunked LM head (patches.ChunkedLinear) returns its chunks' logits
        # unconcatenated: a cat along the stick dim does not plan yet
        # (docs/compiler.md "Lane shuffles"); the cat is a ~vocab x 2 B copy
        n = getattr(head, "n_chunks", None)
        if n is None:
            parts = [head(x)]
        else:
            parts = [
                nn.functional.linear(x, getattr(head, f"w{i}"), getattr(head, f"b{i}"))
                for i in range(n)
            ]
        out = []
        for logits in parts:
            if logit_div is not None:
                logits = logits / logit_div
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            out.append(logits)
        return tuple(out)

    def layer_step(layer, whole, adapters=False):
        # Gemma 4's layers hand their keys/values to later KV-sharing layers
        # through a dict the model passes in (none share here: a fresh one)
        share = "shared_kv_states" in inspect.signature(layer.forward).parameters

        def step(h, cos, sin, positions, keys, values, mask):
            cache = _LayerCache(keys, values, positions, whole)
            extra = {"shared_kv_states": {}} if share else {}
            return layer(
                h, position_embeddings=(cos, sin), attention_mask=mask, cache=cache, **extra
            )

        def step_with_adapters(*args):
            # its own code object: Dynamo keys compiled frames by code and does
            # not guard on module hooks (skip_nnmodule_hook_guards), so the
            # hooked layer would reuse the graph compiled without them
            return step(*args)

        return torch.compile(
            step_with_adapters if adapters else step, fullgraph=True, dynamic=False
        )

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, dynamic=False)

    dev = torch.device("spyre")
    neg = torch.finfo(dtype).min
    kv_bytes = 0
    act = 0
    phase_parts: dict[str, list[Part]] = {"prefill": [], "decode": [], "verify": []}
    prefill_parts, decode_parts = phase_parts["prefill"], phase_parts["decode"]
    if spec_tokens < 0:
        raise ValueError(f"spec_tokens must be >= 0, got {spec_tokens}")
    phases = [("prefill", prompt), ("decode", 1)]
    if spec_tokens:
        phases.append(("verify", 1 + spec_tokens))
    torch_spyre.reset_fallback_counts()
    dispatch_stats.reset("fallback")
    lora_saved_s = 0.0  # the decode step without adapters, less the step with them
    # the estimate wants times, not values: its compilations skip their card
    # work too (sim/card.py timing_only)
    ctx = timing_only_mode(compiles=False) if timing_only else contextlib.nullcontext()
    dyn_cfg = torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096)
    with ctx, dyn_cfg:
        for phase, tokens in phases:
            parts = phase_parts[phase]
            start = 0 if phase == "prefill" else prompt
            # a batch's prefill runs in steps of the token budget (vLLM packs
            # whole prompts into a step's budget): one step planned, counted
            # once per step
            packed = prefill_batch(batch, prompt, token_budget)
            pb, reps = (packed, batch // packed) if phase == "prefill" else (batch, 1)
            ids = torch.zeros(pb, tokens, dtype=torch.long).to(dev)
            pos_h = torch.arange(start, start + tokens)
            pos = pos_h[None].to(dev)
            emb = compiled(embed_step)
            part, outs = _run_part(
                "embedding + rotary tables", reps, lambda e=emb, i=ids, p=pos: e(i, p)
            )
            parts.append(part)
            h, tables = outs[0], outs[1:]
            for i, kind in enumerate(kinds):
                cos, sin = tables[2 * i], tables[2 * i + 1]
                length = kv_len(kind)
                _, n_kv, head_dim = heads_of[kind]
                keys = torch.empty(pb, n_kv, length, head_dim, dtype=dtype, device=dev)
                values = torch.empty(pb, n_kv, length, head_dim, dtype=dtype, device=dev)
                if phase != "prefill":
                    if phase == "decode":
                        kv_bytes += counts[kind] * 2 * keys.numel() * itemsize
                    if start + tokens > length and kind != "sliding_attention":
                        raise NotImplementedError(
                            f"{tokens} query positions at {start} pass the {length}-position cache"
                        )
                    slot = pos_h % length
                    # query position q attends to the cache up to start + q
                    last = (start + torch.arange(tokens)).clamp(max=length - 1)
                    valid = torch.arange(length)[None, :] <= last[:, None]
                    m = torch.zeros(1, 1, tokens, length, dtype=dtype).masked_fill(~valid, neg)
                    mask: torch.Tensor | None = m.to(dev)
                else:
                    slot = pos_h % length
                    mask = None  # causal (is_causal) over the prompt
                    if kind == "sliding_attention" and window and tokens > window:
                        q = torch.arange(tokens)[:, None]
                        k = torch.arange(tokens)[None, :]
                        ok = (k <= q) & (q - k < window)
                        mask = (
                            torch.zeros(1, 1, tokens, tokens, dtype=dtype)
                            .masked_fill(~ok, neg)
                            .to(dev)
                        )
                    if tokens > length:
                        raise NotImplementedError(
                            f"a {tokens}-token prompt is longer than the {length}-position cache"
                        )
                slot_d = slot.to(dev)
                # a prefill with no mask is causal from position 0: over the cache
                fn = layer_step(base.layers[i], whole=phase != "prefill" or mask is None)
                label = f"decoder layer ({kind})"
                parts.append(
                    _run_part(
                        label,
                        counts[kind] * reps,
                        lambda fn=fn, h=h, c=cos, s=sin, p=slot_d, k=keys, v=values, m=mask: fn(
                            h, c, s, p, k, v, m
                        ),
                    )[0]
                )
                if lora is not None and phase == "decode":
                    from torch_spyre.models import lora_estimate

                    layer = base.layers[i]
                    # the stacks are resident: device memory beside the weights
                    extra += counts[kind] * lora_estimate.stack_bytes(layer, lora, dtype)
                    # the step is the layer compiled with the LoRA ops in it
                    # (what a served step with adapter tokens runs); the part
                    # without them is kept to state what the adapters cost
                    without = parts.pop()
                    lora_saved_s += without.total_s
                    with lora_estimate.adapters_on(layer, pb * tokens, lora, dtype):
                        fn = layer_step(layer, whole=True, adapters=True)
                        part = _run_part(
                            label,  # the same layer, with adapters
                            counts[kind] * reps,
                            lambda fn=fn, h=h, c=cos, s=sin, p=slot_d, k=keys, v=values, m=mask: fn(
                                h, c, s, p, k, v, m
                            ),
                        )[0]
                    parts.append(part)
                    lora_saved_s -= part.total_s
                del keys, values
            # the LM head on the last position; a verification step's on all
            # k + 1 (each position's logits check the next draft)
            hs = compiled(functools.partial(head_step, rows=tokens if phase == "verify" else 1))
            parts.append(_run_part("final norm + LM head", reps, lambda f=hs, h=h: f(h))[0])
            coll = parallel.collective_parts(
                whole_cfg, tp, pb, tokens, itemsize, cfg.num_hidden_layers
            )
            if coll:
                parts.append(
                    Part(f"collectives (TP {tp})", reps, sum(t for _, t in coll), kernels=coll)
                )
            act = max(act, *(p.activation_bytes for p in parts))
    fallbacks = sum(int(v) for v in torch_spyre.fallback_counts().values())

    card_cfg = HardwareConfig.from_env()  # TORCH_SPYRE_DEVICE_MEMORY etc., read now
    run_cfg = cards.config()
    quant_params = sum(layer_mm[k] * counts[k] for k in kinds) if weights is not None else 0
    qitem = weights.itemsize if weights is not None else itemsize
    # an 8-bit weight: 1 byte per element and one fp32 scale per output channel
    scale_bytes = (
        sum(counts[k] * _linear_rows(base.layers[i]) for i, k in enumerate(kinds)) * 4
        if weights is not None
        else 0
    )
    weight_bytes = (params - quant_params) * itemsize + quant_params * qitem + scale_bytes
    # decode reads every weight once, except an untied input embedding (one row)
    decode_weights = weight_bytes - (0 if tied else emb_params * itemsize)
    # a mixture of experts: every expert is resident, a decode step reads only
    # the experts its tokens are routed to (top-k each; experts_touched); the
    # experts stay ``dtype`` (stacked tensors, not nn.Linear: not quantised)
    for k in kinds:
        e_params, num = layer_experts[k]
        if e_params:
            unread = 1.0 - experts_touched(num, top_k, batch) / num
            decode_weights -= round(counts[k] * e_params * itemsize * unread)
    kv_read = batch * sum(
        counts[k] * 2 * heads_of[k][1] * min(prompt + 1, kv_len(k)) * heads_of[k][2] * itemsize
        for k in kinds
    )
    # prefill FLOP: 2 x tokens x matmul weights, causal attention (QK^T and PV over
    # the (query, key) pairs each layer attends), the LM head on the last position
    flops = 0.0
    for k in kinds:
        w = window if (k == "sliding_attention" and window) else prompt
        pairs = sum(min(i + 1, w) for i in range(prompt))
        # routed experts: top_k of num per token
        e_params, num = layer_experts[k]
        active = layer_mm[k] + (e_params * top_k // num if num else 0)
        flops += counts[k] * (2 * prompt * active + 4 * pairs * heads_of[k][2] * heads_of[k][0])
    flops += 2 * lm_head_params
    flops *= batch
    # memory per card at every valid split, for "needs N cards"
    per_card = {}
    kv_kinds = layer_kinds
    for n in range(1, parallel.MAX_CARDS + 1):
        if n == tp:
            per_card[n] = weight_bytes + extra + kv_bytes + act
            continue
        try:
            w = parallel.card_weight_bytes(whole_cfg, n, dtype)  # checks the split
        except (ValueError, NotImplementedError):
            continue
        w = int(w * weight_bytes / max(params * itemsize, 1))  # 8-bit weights scale alike
        kv_n = parallel.kv_bytes_per_card(whole_cfg, n, batch, cache_len, itemsize, kv_kinds)
        per_card[n] = w + extra * tp // n + kv_n + act
    est = Estimate(
        model=key,
        source=spec["source"],
        config_class=spec["config_class"],
        dtype=str(dtype).replace("torch.", ""),
        params=params,
        embedding_params=emb_params,
        tied_embeddings=tied,
        layers=dict(counts),
        prompt_tokens=prompt,
        cache_len=cache_len,
        prefill=prefill_parts,
        decode=decode_parts,
        lora_s=-lora_saved_s if lora is not None else 0.0,
        verify=phase_parts["verify"],
        spec_tokens=spec_tokens,
        weights_bytes=weight_bytes,
        extra_weight_bytes=extra,
        kv_cache_bytes=kv_bytes,
        activation_bytes=act,
        card_memory_bytes=card_cfg.device_memory_bytes,
        peak_bandwidth_Bps=run_cfg.memory_bandwidth_Bps,
        sustained_bandwidth_Bps=run_cfg.sustained_bandwidth_Bps,
        peak_flops=run_cfg.peak_flops(torch.float16),
        decode_bytes=decode_weights + kv_read,
        prefill_flops=flops,
        host_fallbacks=fallbacks,
        plan_wall_s=time.perf_counter() - t_wall,
        weights_dtype=str(weights or dtype).replace("torch.", ""),
        quantized_params=quant_params,
        batch=batch,
        prefill_batch=prefill_batch(batch, prompt, token_budget),
        token_budget=token_budget,
        tp=tp,
        model_params=model_params or params,
        per_card_bytes=per_card,
        expert_params=expert_params,
        num_experts=num_experts if expert_params else 0,
        top_k=top_k,
        active_params=active_params,
        cards_needed=parallel.cards_needed(
            whole_cfg, dtype, card_cfg.device_memory_bytes, per_card
        ),
    )
    from torch_spyre.models import host_estimate

    # IBM's published figures are batch-1 decode on one card
    published = host_estimate.PUBLISHED_DECODE.get(name, {}) if tp == 1 and batch == 1 else {}
    est.host_path = host_estimate.host_path(est, card_cfg, published=published)
    return est
