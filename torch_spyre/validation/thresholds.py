"""Pass/fail thresholds of the model validation, per model, in one table.

Both sides start from the same fp32 weights and the same token ids, so every
difference comes from how the card computes (fp32 accumulation in another
order, per-core partial sums; see torch_spyre/testing.py).  The thresholds are
what issue 7 asks for where it names a number; the others are set with about
10x headroom over what was measured (docs/models.md quotes the measurements),
so that a real numerical regression, not noise, fails them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Thresholds:
    # embedding models
    #: minimum over sentences of cos(pooled spyre, pooled cpu)
    pooled_cosine: float | None = None
    #: minimum over real (unpadded) tokens of cos(hidden spyre, hidden cpu)
    token_cosine: float | None = None
    # causal LMs
    #: fraction of prompts whose greedy continuation is identical over all steps
    greedy_identical: float | None = None
    #: teacher-forced: fraction of steps where spyre's top-1 token equals the CPU's
    top1: float | None = None
    #: teacher-forced: largest |logit(spyre) - logit(cpu)| over all steps
    max_logit_diff: float | None = None
    #: teacher-forced: largest KL(p_spyre || p_cpu) = CE(p_spyre, p_cpu) - H(p_spyre), nats
    max_kl: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


EMBEDDING_DEFAULT = Thresholds(pooled_cosine=0.999, token_cosine=0.999)
CAUSAL_LM_DEFAULT = Thresholds(greedy_identical=0.8, top1=0.99, max_logit_diff=1e-2, max_kl=1e-4)

#: keyed by offline model name (torch_spyre.models.offline) or "<kind>:default"
THRESHOLDS: dict[str, Thresholds] = {
    # issue 7: pooled cosine at least 0.999
    "all-minilm-l6-v2": EMBEDDING_DEFAULT,
    "all-mpnet-base-v2": EMBEDDING_DEFAULT,
    # issue 7: 32 greedy tokens identical on at least 4 of 5 prompts, top-1 at least 99%
    "smollm2-135m-instruct": CAUSAL_LM_DEFAULT,
    "embedding:default": EMBEDDING_DEFAULT,
    "causal-lm:default": CAUSAL_LM_DEFAULT,
    # fp16 on the card vs the fp32 CPU reference: the token criteria stay, the logit
    # criteria widen to what fp16 rounding of ~20-magnitude logits gives (measured on
    # SmolLM2: max |logit diff| 0.13, max KL 2.8e-4; ~4-10x headroom)
    "causal-lm:default:float16": Thresholds(
        greedy_identical=0.8, top1=0.99, max_logit_diff=1.0, max_kl=3e-3
    ),
    "embedding:default:float16": Thresholds(pooled_cosine=0.999, token_cosine=0.99),
}


def thresholds_for(name: str | None, kind: str, dtype: str = "float32") -> Thresholds:
    """The most specific entry: ``name:dtype``, ``kind:default:dtype``, then (fp32) ``name``,
    ``kind:default``.  Other dtypes (bf16) are not calibrated and get the fp32 entry."""
    keys = [f"{name}:{dtype}", f"{kind}:default:{dtype}", str(name), f"{kind}:default"]
    for key in keys:
        if key in THRESHOLDS:
            return THRESHOLDS[key]
    raise KeyError(kind)
