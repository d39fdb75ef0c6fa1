"""Validate a model on spyre against a CPU fp32 reference.

    report = torch_spyre.validation.validate("smollm2", steps=32)
    print(report.format()); report.save_json("out.json"); assert report.passed

Embedding models: per-token and pooled (mean over the attention mask,
normalised) cosine between spyre and CPU hidden states.

Causal LMs: (1) greedy decoding on both sides (prefill, then one token per
step through the KV cache), compared token by token; (2) teacher forcing: the
CPU's greedy tokens are appended to each prompt and both sides run it in one
forward; per step we report max |logit diff|, top-1 agreement and the
cross-entropy CE(p_spyre, p_cpu) = -sum p_spyre log p_cpu (the metric IBM's
validation uses) with the KL divergence CE - H(p_spyre).  The prompts of a
case are batched (left padded); both sides see the same padded batch.

Pass/fail thresholds live in ``torch_spyre.validation.thresholds``.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_spyre.validation.thresholds import THRESHOLDS, Thresholds, thresholds_for

#: the fixed prompts of the causal-LM validation
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers:",
)

#: the fixed sentences of the embedding validation
SENTENCES: tuple[str, ...] = (
    "The spyre card has 32 cores on a ring.",
    "A dataflow accelerator with thirty-two cores connected by a ring network.",
    "Bananas are rich in potassium.",
    "PyTorch tensors can be moved to an accelerator with .to().",
    "A man is playing a guitar on the street.",
)


@dataclass
class Report:
    model: str
    kind: str
    device_dtype: str
    metrics: dict[str, float]
    thresholds: dict[str, float]
    failures: list[str]
    #: per-case (per-prompt or per-sentence) details
    cases: list[dict[str, Any]] = field(default_factory=list)
    fallback_counts: dict[str, int] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    modelled_device_s: float = 0.0
    #: the spyre side ran through torch.compile (else eager, op by op)
    compiled: bool = False
    #: the compiler's degrade steps while compiling (compiler/degrade.py:
    #: groups split, nodes and matmuls run as eager kernels in the graph) and
    #: the runs of such nodes
    compile_degraded: dict[str, int] = field(default_factory=dict)
    degraded_runs: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def format(self) -> str:
        lines = [
            f"validation of {self.model} ({self.kind}) on spyre [{self.device_dtype}, "
            f"{'compiled' if self.compiled else 'eager'}] vs cpu fp32"
        ]
        if self.patches:
            lines.append("  adapter patches: " + "; ".join(self.patches))
        for c in self.cases:
            # per-step lists and tokens are in the JSON; the readable report keeps scalars
            scalars = {k: v for k, v in c.items() if not isinstance(v, list | str)}
            lines.append("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in scalars.items()))
        lines.append(f"  {'metric':<24}  {'value':<14}  threshold")
        for k, v in self.metrics.items():
            thr = self.thresholds.get(k)
            lines.append(f"  {k:<24}  {_fmt(v):<14}  {'' if thr is None else _fmt(thr)}")
        fb = sum(self.fallback_counts.values())
        lines.append(f"  host fallbacks: {fb} calls {dict(self.fallback_counts) if fb else ''}")
        if self.compiled:
            d = self.compile_degraded
            runs = sum(self.degraded_runs.values())
            lines.append(
                f"  compiler degrade: {d.get('split', 0)} groups split, {d.get('eager', 0)} nodes "
                f"and {d.get('eager_extern', 0)} matmuls as eager kernels in the graph "
                f"({runs} runs)"
            )
        lines.append(
            f"  wall {self.wall_s:.1f} s, modelled device time {self.modelled_device_s * 1e3:.1f} ms"
        )
        lines.append("PASS" if self.passed else "FAIL: " + "; ".join(self.failures))
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.8g}"
    if isinstance(v, list):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


def _check(metrics: dict[str, float], thr: Thresholds) -> list[str]:
    """Names of the metrics that miss their threshold (lower bound unless max_*)."""
    failures = []
    for k, limit in thr.as_dict().items():
        if k not in metrics:
            continue
        v = metrics[k]
        bad = v > limit if k.startswith("max_") else v < limit
        if bad:
            failures.append(
                f"{k} = {_fmt(v)} misses {'<=' if k.startswith('max_') else '>='} {limit}"
            )
    return failures


# ------------------------------------------------------------------ embeddings
def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


def compare_embeddings(
    ref: nn.Module, dev: nn.Module, batch: dict[str, torch.Tensor], device: str = "spyre"
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Metrics and per-sentence cases of a spyre/CPU embedding comparison."""
    with torch.no_grad():
        h_ref = ref(**batch).last_hidden_state
        dev_batch = {k: v.to(device) for k, v in batch.items()}
        h_dev = dev(**dev_batch).last_hidden_state.cpu().float()
    mask = batch["attention_mask"].bool()
    tok_cos = nn.functional.cosine_similarity(h_dev, h_ref, dim=-1)  # (batch, seq)
    pooled = nn.functional.cosine_similarity(
        _mean_pool(h_dev, batch["attention_mask"]),
        _mean_pool(h_ref, batch["attention_mask"]),
        dim=-1,
    )
    cases = [
        {
            "case": i,
            "tokens": int(mask[i].sum()),
            "token_cosine_min": tok_cos[i][mask[i]].min().item(),
            "pooled_cosine": pooled[i].item(),
        }
        for i in range(len(pooled))
    ]
    metrics = {
        "pooled_cosine": pooled.min().item(),
        "token_cosine": tok_cos[mask].min().item(),
        "token_cosine_mean": tok_cos[mask].mean().item(),
        "max_abs_diff": (h_dev - h_ref)[mask].abs().max().item(),
    }
    return metrics, cases


# ------------------------------------------------------------------ causal LMs
def _logits(out) -> torch.Tensor:
    return out.logits[:, -1].to("cpu", torch.float32)


def greedy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int,
    device: str | torch.device | None = None,
    progress=None,
) -> torch.Tensor:
    """``steps`` greedy tokens per row (batch, steps): prefill, then decode through a
    static cache (``models.generate``: one shape per bucket, so a compiled model
    compiles once for the prefill and once for decoding).  The model runs where
    its parameters are (``device`` is accepted for older callers).

    The argmax is taken on the host from the logits, so both sides break ties alike.
    """
    from torch_spyre.models.generate import generate

    out = generate(model, input_ids, steps, attention_mask=attention_mask)
    if progress is not None:
        progress.update(steps)
    return out.tokens


def _teacher_forced_logits(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int, steps: int, device
) -> torch.Tensor:
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device)
        )
    # the logits that predict the `steps` continuation tokens
    return out.logits[:, prompt_len - 1 : prompt_len - 1 + steps].to("cpu", torch.float32)


def compare_causal_lm(
    ref: nn.Module,
    dev: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    steps: int,
    device: str = "spyre",
    progress: bool = False,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy and teacher-forced comparison of a causal LM on ``device`` vs the CPU.

    ``input_ids``/``attention_mask``: a left-padded batch of prompts (one row a case).
    """
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * steps + 1, desc="greedy cpu+spyre, teacher-forced", unit="step")
    ref_tok = greedy(ref, input_ids, attention_mask, steps, "cpu", bar)
    dev_tok = greedy(dev, input_ids, attention_mask, steps, device, bar)
    # teacher forcing: both sides see the prompt followed by the CPU's tokens
    ids = torch.cat([input_ids, ref_tok], dim=-1)
    mask = torch.cat([attention_mask, torch.ones_like(ref_tok)], dim=-1)
    n = input_ids.shape[1]
    lr = _teacher_forced_logits(ref, ids, mask, n, steps, "cpu")
    ld = _teacher_forced_logits(dev, ids, mask, n, steps, device)
    if bar is not None:
        bar.update(1)
        bar.close()
    logp_ref = lr.log_softmax(-1)
    logp_dev = ld.log_softmax(-1)
    p_dev = logp_dev.exp()
    ce = -(p_dev * logp_ref).sum(-1)  # (batch, steps)
    entropy = -(p_dev * logp_dev).sum(-1)
    kl = (ce - entropy).clamp(min=0)
    diff = (ld - lr).abs().amax(-1)  # (batch, steps)
    top1 = ld.argmax(-1) == lr.argmax(-1)
    same = ref_tok == dev_tok
    cases = []
    for i in range(ids.shape[0]):
        bad = (~same[i]).nonzero()
        cases.append(
            {
                "case": i,
                "greedy_identical": bool(same[i].all()),
                "first_divergence": int(bad[0]) if len(bad) else -1,
                "top1": top1[i].float().mean().item(),
                "max_logit_diff": diff[i].max().item(),
                "max_ce": ce[i].max().item(),
                "max_kl": kl[i].max().item(),
                "per_step_max_logit_diff": [round(v, 7) for v in diff[i].tolist()],
                "per_step_ce": [round(v, 6) for v in ce[i].tolist()],
                "tokens_cpu": ref_tok[i].tolist(),
                "tokens_spyre": dev_tok[i].tolist(),
            }
        )
    metrics = {
        "greedy_identical": same.all(-1).float().mean().item(),
        "greedy_token_agreement": same.float().mean().item(),
        "top1": top1.float().mean().item(),
        "max_logit_diff": diff.max().item(),
        "mean_ce": ce.mean().item(),
        "max_kl": kl.max().item(),
    }
    return metrics, cases


# ------------------------------------------------------------------ entry points
def validate_models(
    ref: nn.Module,
    dev: nn.Module,
    *,
    kind: str,
    inputs: dict[str, torch.Tensor],
    steps: int = 8,
    name: str = "model",
    thresholds: Thresholds | None = None,
    device: str = "spyre",
    progress: bool = False,
) -> Report:
    """Compare an already-prepared device model with its CPU reference on ``inputs``."""
    import torch_spyre

    dtype = str(next(dev.parameters()).dtype).removeprefix("torch.")
    thr = thresholds or thresholds_for(name, kind, dtype)
    from torch_spyre.compiler import degrade
    from torch_spyre.runtime import dispatch_stats

    torch_spyre.reset_fallback_counts()
    degrade_before = degrade.counts()
    dispatch_stats.reset("degraded")
    t_model = torch.spyre.modelled_time_s()
    wall = time.perf_counter()
    if kind == "embedding":
        metrics, cases = compare_embeddings(ref, dev, inputs, device)
    else:
        metrics, cases = compare_causal_lm(
            ref, dev, inputs["input_ids"], inputs["attention_mask"], steps, device, progress
        )
    return Report(
        model=name,
        kind=kind,
        device_dtype=dtype,
        metrics=metrics,
        thresholds=thr.as_dict(),
        failures=_check(metrics, thr),
        cases=cases,
        fallback_counts=dict(torch_spyre.fallback_counts()),
        patches=list(getattr(dev, "spyre_patches", [])),
        wall_s=time.perf_counter() - wall,
        modelled_device_s=torch.spyre.modelled_time_s() - t_model,
        compiled=bool(getattr(dev, "spyre_compiled", False)),
        compile_degraded={k: n - degrade_before[k] for k, n in degrade.counts().items()},
        degraded_runs=dict(dispatch_stats.counts("degraded")),
    )


def validate(
    model: str,
    *,
    steps: int = 32,
    prompts: int | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    compile: bool = False,
) -> Report:
    """Load ``model`` (offline name or folder) on CPU and spyre and compare them.

    ``prompts``: how many of the fixed prompts/sentences to use (default all);
    ``compile``: run the spyre side through ``torch.compile`` (the spyre backend).
    """
    from torch_spyre import models

    _, kind = models.resolve(model)
    ref = models.load_reference(model, kind=kind)
    kind = kind or models.kind_of(ref.config)
    tok = models.load_tokenizer(model)
    known = models.offline.lookup(model)
    name = known.name if known else str(model)
    dev = models.prepare(copy.deepcopy(ref), dtype=dtype, compile=compile)
    if kind == "embedding":
        texts = list(SENTENCES[:prompts])
        batch = tok(texts, padding=True, return_tensors="pt")
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        if "token_type_ids" in batch:
            inputs["token_type_ids"] = batch["token_type_ids"]
    else:
        texts = list(PROMPTS[:prompts])
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        batch = tok(texts, padding=True, return_tensors="pt")
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    report = validate_models(
        ref, dev, kind=kind, inputs=inputs, steps=steps, name=name, progress=progress
    )
    for case, text in zip(report.cases, texts):
        case["text"] = text
    return report


__all__ = [
    "PROMPTS",
    "SENTENCES",
    "THRESHOLDS",
    "Report",
    "Thresholds",
    "compare_causal_lm",
    "compare_embeddings",
    "greedy",
    "thresholds_for",
    "validate",
    "validate_models",
]
