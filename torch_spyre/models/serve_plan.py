"""``spyre estimate MODEL --serve``: a serving plan from vLLM's own scheduler.

vLLM's v1 ``Scheduler`` (continuous batching, chunked prefill, paged KV
blocks, preemption) runs exactly as in a server, with a KV cache sized from
one card's free device memory; nothing is computed: each step's modelled
time comes from the model's planned estimates (``estimate.estimate``) and the
step's "sampled" tokens are placeholders.  Requests arrive as a seeded
Poisson process at ``rate`` per second, each ``input_len`` prompt tokens and
``output_len`` new tokens.

Step time (from two planned estimates at ``tp`` cards: batch 1 and batch
``max_num_seqs``, prompt ``input_len``, cache ``input_len + output_len``):

* prefill tokens cost ``P1 / input_len`` each (P1: the planned batch-1
  prefill; attention's quadratic term is folded in at that length);
* ``d`` decoding requests cost ``D1 + m * (d - 1)`` with
  ``m = (DB - D1) / (B - 1)`` (D1, DB: planned decode steps at batch 1 and B);
* a step with both reads the weights once: ``max(prefill, D1 - m) + m * d``.

Reported: throughput (output tokens/s, requests/s), TTFT and TPOT p50/p99 in
modelled seconds.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class StepModel:
    prefill_per_token_s: float
    decode_1_s: float
    decode_marginal_s: float

    def time(self, prefill_tokens: int, decodes: int) -> float:
        pre = self.prefill_per_token_s * prefill_tokens
        if decodes == 0:
            return pre
        base = self.decode_1_s - self.decode_marginal_s
        if prefill_tokens == 0:
            return base + self.decode_marginal_s * decodes
        return max(pre, base) + self.decode_marginal_s * decodes

    @staticmethod
    def from_estimates(one, many, input_len: int, spec=None) -> StepModel:
        """``spec``: a decode step is a speculative one, ``(draft seconds at
        batch 1, at batch B)`` on top of the planned verification steps."""
        b = many.batch
        d1, db = one.decode_s, many.decode_s
        if spec is not None:
            d1, db = one.verify_s + spec[0], many.verify_s + spec[1]
        m = (db - d1) / (b - 1) if b > 1 else 0.0
        return StepModel(one.prefill_s / input_len, d1, max(m, 0.0))


@dataclass
class ServePlan:
    model: str
    tp: int
    rate: float
    input_len: int
    output_len: int
    requests: int
    max_num_seqs: int
    kv_blocks: int
    kv_blocks_capacity: int
    step_model: StepModel
    duration_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    @property
    def throughput_tokens_s(self) -> float:
        return self.requests * self.output_len / self.duration_s if self.duration_s else 0.0

    @property
    def throughput_requests_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    def pct(self, xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ttft_s"), d.pop("tpot_s")
        d.update(
            throughput_tokens_s=self.throughput_tokens_s,
            throughput_requests_s=self.throughput_requests_s,
            ttft_p50_s=self.pct(self.ttft_s, 50),
            ttft_p99_s=self.pct(self.ttft_s, 99),
            tpot_p50_s=self.pct(self.tpot_s, 50),
            tpot_p99_s=self.pct(self.tpot_s, 99),
        )
        return d

    def format(self) -> str:
        j = self.to_json()
        return (
            f"serving {self.model} on {self.tp} card{'s' if self.tp > 1 else ''}: "
            f"{self.rate:g} requests/s offered, {self.input_len} in / {self.output_len} out, "
            f"{self.requests} requests ({self.max_num_seqs} at most per step, "
            f"{self.kv_blocks} KV blocks used of {self.kv_blocks_capacity} that fit)\n"
            f"  throughput {j['throughput_tokens_s']:.1f} output tokens/s, "
            f"{j['throughput_requests_s']:.2f} requests/s over {self.duration_s:.2f} s "
            f"modelled ({self.steps} steps, {self.preemptions} preemptions)\n"
            f"  TTFT p50 {j['ttft_p50_s'] * 1e3:.1f} ms, p99 {j['ttft_p99_s'] * 1e3:.1f} ms; "
            f"TPOT p50 {j['tpot_p50_s'] * 1e3:.2f} ms, p99 {j['tpot_p99_s'] * 1e3:.2f} ms"
        )


def _vllm_config(cfg, max_num_seqs: int, max_len: int, dtype: torch.dtype, spec_k: int = 0):
    from vllm.engine.arg_utils import EngineArgs

    folder = tempfile.mkdtemp(prefix="spyre-plan-")
    cfg.to_json_file(os.path.join(folder, "config.json"))
    args = EngineArgs(
        model=folder,
        skip_tokenizer_init=True,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        # TP is in the step model; vLLM's scheduler is the same at any TP
        tensor_parallel_size=1,
        enforce_eager=True,
        # every planned request has its own prompt: no prefix hits
        enable_prefix_caching=False,
        # speculation: the scheduler schedules each decoding request's k
        # drafts with its token (only the draft count matters to it; the
        # drafter's cost is in the step model)
        speculative_config=(
            {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
        ),
    )
    return args.create_engine_config()


def plan(
    est_one,
    est_many,
    cfg,
    *,
    rate: float,
    input_len: int,
    output_len: int,
    requests: int = 200,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    progress=None,
    speculation=None,
    draft_s: tuple[float, float] = (0.0, 0.0),
) -> ServePlan:
    """Run vLLM's scheduler on Poisson arrivals with modelled step times.

    ``speculation`` (``spec_estimate.SpecOptions``): decode steps verify k drafts
    per request (the estimates planned with ``spec_tokens=k``); each draft is
    accepted with the given probability until the first rejection (seeded),
    and ``draft_s`` is drafting's card time per step at batch 1 and B."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    if rate <= 0 or input_len < 1 or output_len < 1 or requests < 1:
        raise ValueError("--rate, --input-len, --output-len and the request count must be > 0")
    steps_model = StepModel.from_estimates(
        est_one, est_many, input_len, spec=draft_s if speculation is not None else None
    )
    max_seqs = est_many.batch
    k = speculation.k if speculation is not None else 0
    vcfg = _vllm_config(cfg, max_seqs, input_len + output_len, dtype, spec_k=k)
    block = vcfg.cache_config.block_size
    from torch_spyre.models import parallel

    shard = parallel.shard_config(cfg, est_one.tp)
    # one card's (KV heads, head_dim) per layer: a heterogeneous config (Gemma 4)
    # has its own per layer; sliding-window layers are counted as full ones (exact
    # while a request's input + output fits the window, an over-count beyond)
    hetero = getattr(shard, "is_heterogeneous", False)
    shapes = []
    for i in range(cfg.num_hidden_layers):
        lc = shard.per_layer_config[i] if hetero else shard
        hd = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
        shapes.append((lc.num_key_value_heads, hd))
    itemsize = dtype.itemsize
    # the scheduler counts blocks only; the spec names the first layer's shape
    spec = FullAttentionSpec(
        block_size=block, num_kv_heads=shapes[0][0], head_size=shapes[0][1], dtype=dtype
    )
    # KV blocks: what one card's memory holds after the weights and activations
    free = est_one.card_memory_bytes - (
        est_one.weights_bytes + est_one.extra_weight_bytes + est_many.activation_bytes
    )
    per_block = sum(2 * kv * block * hd * itemsize for kv, hd in shapes)
    capacity = int(free // per_block)
    need = -(-(input_len + output_len) // block)
    # never more than max_num_seqs full requests use at once (keeps vLLM's block
    # pool small for a 112 GiB card)
    blocks = min(capacity, max_seqs * need)
    if capacity < need:
        raise ValueError(
            f"no room for one request's KV cache on a card ({capacity} blocks of {block} "
            f"tokens, a request needs {need}): use more cards (--tp) or shorter requests"
        )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)]
    kv_cfg = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    vcfg.cache_config.num_gpu_blocks = blocks  # as the engine sets it after profiling
    sched = Scheduler(vcfg, kv_cfg, StructuredOutputManager(vcfg), block_size=block)
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    result = ServePlan(
        est_one.model, est_one.tp, rate, input_len, output_len, requests, max_seqs, blocks,
        capacity, steps_model,
    )  # fmt: skip
    clock, nxt, done = 0.0, 0, 0
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    produced: dict[str, int] = {}
    while done < requests:
        while nxt < requests and arrivals[nxt] <= clock:
            rid = str(nxt)
            sched.add_request(
                Request(rid, [1] * input_len, params, None, arrival_time=arrivals[nxt])
            )
            arrived[rid] = arrivals[nxt]
            nxt += 1
        out = sched.schedule()
        if out.total_num_scheduled_tokens == 0:
            if nxt >= requests:
                raise RuntimeError("vLLM's scheduler stalled with requests left")
            clock = max(clock, arrivals[nxt])
            continue
        pre = dec = 0
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            n = out.num_scheduled_tokens[rid]
            req = sched.requests[rid]
            before = req.num_computed_tokens - n  # schedule() already advanced it
            if before >= req.num_prompt_tokens:
                dec += 1
            else:
                pre += n
            if req.num_computed_tokens < req.num_prompt_tokens:
                sampled.append([])
                continue
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            accepted = 0
            while accepted < drafts and rng.random() < speculation.acceptance:
                accepted += 1
            sampled.append([1] * (accepted + 1))
        clock += steps_model.time(pre, dec)
        result.steps += 1
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        for i, (rid, tok) in enumerate(zip(ids, sampled)):
            if tok:
                had = produced.get(rid, 0)
                if had == 0:
                    first[rid] = clock
                    result.ttft_s.append(clock - arrived[rid])
                # the tokens past max_tokens are dropped, as vLLM does
                tok = sampled[i] = tok[: output_len - had]
                produced[rid] = had + len(tok)
                if produced[rid] == output_len:
                    done += 1
                    result.preemptions += sched.requests[rid].num_preemptions
                    if output_len > 1:
                        result.tpot_s.append((clock - first[rid]) / (output_len - 1))
        sched.update_from_output(out, mro)
        if k:
            # the drafter's proposals for the next step (placeholder ids)
            live = [r for r, tok in zip(ids, sampled) if tok and r in sched.requests]
            sched.update_draft_token_ids(DraftTokenIds(live, [[1] * k for _ in live]))
        if progress is not None:
            progress(done, requests)
    result.duration_s = clock - arrivals[0]
    return result


def sweep_plot(plans: list[ServePlan], path: str) -> None:
    """Throughput vs offered rate (and TPOT p50) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p.rate for p in plans]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [p.throughput_requests_s for p in plans], "o-", label="served requests/s")
    ax.plot(rates, rates, ":", color="grey", label="offered")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [p.pct(p.tpot_s, 50) * 1e3 for p in plans], "s--", color="C1", label="TPOT p50")
    ax2.set_ylabel("TPOT p50 (ms)")
    ax.set_title(
        f"{plans[0].model}, {plans[0].tp} card(s), {plans[0].input_len}/{plans[0].output_len}"
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def dumps(plans: list[ServePlan]) -> str:
    return json.dumps([p.to_json() for p in plans], indent=1)
