"""``spyre estimate --spec METHOD,k,acceptance``: decode with speculation, modelled.

A speculative step verifies every request's k drafts in one forward over
k + 1 query positions (``estimate(..., spec_tokens=k)`` plans it: the
verification step, ``Estimate.verify``), so the weights are read once for up
to k + 1 tokens.  With each draft token accepted with probability ``a``
independently of the others (the acceptance *rate* a user measures, e.g. from
vLLM's ``spec_decode`` metrics), a step yields

    E = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens per request (the accepted prefix plus the target's bonus or recovered
token; Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023).  Drafting costs, on the card:

* ``ngram``: nothing (vLLM's prompt lookup runs on the host);
* ``draft_model``: the draft model's forward over the step's k + 1 tokens
  (its verify-shaped pass: vLLM's drafter first runs on the target's
  accepted tokens) and k - 1 single-token decode steps, each planned for the
  draft model (``--draft``: a model name, a config.json, or ``layers=N`` for
  the target's first N layers with its embedding and LM head).

Tokens per second per request = E / (verification step + drafting); the
speed-up is against the planned decode step without speculation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpecOptions:
    method: str
    k: int
    acceptance: float

    @staticmethod
    def parse(text: str) -> SpecOptions:
        """``METHOD,k,acceptance`` (``ngram,3,0.7``)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3:
            raise ValueError(f"--spec wants METHOD,k,acceptance (e.g. ngram,3,0.7), got {text!r}")
        method, k_text, a_text = parts
        if method not in METHODS:
            raise ValueError(f"--spec method {method!r}: one of {', '.join(METHODS)}")
        try:
            k, a = int(k_text), float(a_text)
        except ValueError:
            raise ValueError(f"--spec {text!r}: k is an integer, acceptance a number") from None
        if not 1 <= k <= 16:
            raise ValueError(f"--spec k must be 1..16 draft tokens, got {k}")
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"--spec acceptance is a probability in [0, 1], got {a}")
        return SpecOptions(method, k, a)


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a request gains per verification step (see the module doc)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class SpecPlan:
    method: str
    k: int
    acceptance: float
    batch: int
    decode_s: float  # a decode step without speculation
    verify_s: float  # the verification step (k + 1 positions per request)
    draft_s: float  # drafting on the card per step
    draft_model: str = ""
    draft_weights_bytes: int = 0

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens(self.k, self.acceptance)

    @property
    def step_s(self) -> float:
        return self.verify_s + self.draft_s

    @property
    def tokens_per_s_per_request(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def speedup(self) -> float:
        return self.tokens_per_s_per_request * self.decode_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            tokens_per_step=self.tokens_per_step,
            step_s=self.step_s,
            tokens_per_s_per_request=self.tokens_per_s_per_request,
            tokens_per_s=self.tokens_per_s_per_request * self.batch,
            speedup=self.speedup,
        )
        return d

    def format(self) -> str:
        draft = (
            f" + drafting {self.draft_s * 1e3:.1f} ms ({self.draft_model}, "
            f"{self.draft_weights_bytes / 1e9:.2f} GB of weights)"
            if self.method == "draft_model"
            else " (drafts by prompt lookup on the host)"
        )
        return (
            f"  speculation ({self.method}, k={self.k}, acceptance {self.acceptance:.2f} per draft"
            f" token): {self.tokens_per_step:.2f} tokens per step\n"
            f"    verification step {self.verify_s * 1e3:.1f} ms{draft}"
            f" -> {self.tokens_per_s_per_request:.1f} tokens/s per request,"
            f" {self.tokens_per_s_per_request * self.batch:.1f} in all"
            f" ({self.speedup:.2f}x the {self.decode_s * 1e3:.1f} ms decode step)"
        )


def draft_estimate(draft: str, target_name: str, target_cfg, common: dict[str, Any]):
    """The draft model's estimate with a verification step of k tokens."""
    from torch_spyre.models import estimate, parallel

    if draft.startswith("layers="):
        n = int(draft.removeprefix("layers="))
        total = target_cfg.num_hidden_layers
        if not 1 <= n < total:
            raise ValueError(f"--draft layers=N: N in 1..{total - 1}, got {n}")
        cfg = type(target_cfg).from_dict(target_cfg.to_dict())
        cfg.num_hidden_layers = n
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:n]
        label = f"{target_name}'s first {n} of {total} layers"
        return estimate.estimate(target_name, config=cfg, **common), label
    if draft.endswith(".json") or "/" in draft:
        cfg = parallel.load_config(draft)
        return estimate.estimate(draft, config=cfg, **common), draft
    return estimate.estimate(draft, **common), draft


def plan(target, opts: SpecOptions, draft=None, draft_label: str = "") -> SpecPlan:
    """``target``: an estimate with ``spec_tokens == opts.k``; ``draft``: the
    draft model's (draft_model), with the same k."""
    if target.spec_tokens != opts.k or not target.verify:
        raise ValueError("the target estimate needs spec_tokens=k (its verification step)")
    draft_s = 0.0
    draft_bytes = 0
    if opts.method == "draft_model":
        if draft is None or draft.spec_tokens != opts.k:
            raise ValueError("--spec draft_model needs --draft (planned with the same k)")
        draft_s = draft.verify_s + (opts.k - 1) * draft.decode_s
        draft_bytes = draft.weights_bytes
    return SpecPlan(
        opts.method,
        opts.k,
        opts.acceptance,
        target.batch,
        target.decode_s,
        target.verify_s,
        draft_s,
        draft_label,
        draft_bytes,
    )
