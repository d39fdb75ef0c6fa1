"""One model type on the card against the CPU: eager, then compiled.

The reference is the tiny model in fp32 on the CPU.  A causal LM that runs
through a static cache is compared in *decode* mode: a prefill and
``STEPS - 1`` decode steps, the device fed the CPU's tokens (teacher forcing
through the cache), so every step's logits are compared against the same
context: a compiled decode graph that drifts shows at the step it drifts.
Anything else (encoders, models without a static cache) is compared in
*forward* mode: one forward over a fixed input.

Both sides run fp32, so the tolerance is fp32's, not fp16's: the card
accumulates in another order than the CPU, which moves a logit by a few ulps
of the largest one per reduction; ``RTOL`` of the largest reference logit
(plus ``ATOL`` for logits near zero) holds that with a margin of ~100 and
still catches any wrong value (a wrong expert, a stale cache row, a missed
mask moves logits by a good fraction of their scale).  Greedy picks that
differ are counted (``token_flips``); within the tolerance they are near-ties
(a flip needs a logit difference of at least half the gap between the
reference's two best), beyond it the verdict is already a mismatch.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torch_spyre.tools.archsweep.configs import VARIANTS, WIDE_HIDDEN, ModelType, tiny_config

STEPS = 4
PROMPT = 8
#: ``--wide``'s prompt: 64 rows, where the norm and projections fuse
WIDE_PROMPT = 64
RTOL = 1e-3
ATOL = 1e-4


@dataclass
class PathResult:
    """One side (eager or compiled) of a type's run."""

    verdict: str = "n/a"  # match | mismatch | error
    max_diff: float = float("nan")
    scale: float = float("nan")
    token_flips: int = 0
    host_fallbacks: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    degraded: dict[str, int] = field(default_factory=dict)
    modelled_ms_per_token: float = float("nan")
    error: str = ""
    wall_s: float = 0.0


@dataclass
class Row:
    type: str
    family: str
    status: str = "ok"  # ok | cpu-error (the tiny model does not run on the CPU)
    mode: str = ""  # decode | forward
    params_m: float = 0.0
    eager: PathResult = field(default_factory=PathResult)
    compiled: PathResult = field(default_factory=PathResult)
    error: str = ""
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        d = dict(d)
        d["eager"] = PathResult(**d.get("eager", {}))
        d["compiled"] = PathResult(**d.get("compiled", {}))
        return cls(**d)


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def build(mt: ModelType, variant: int = 0, wide: bool = False) -> torch.nn.Module:
    import transformers

    cfg = tiny_config(mt.name, variant, **({"hidden": WIDE_HIDDEN} if wide else {}))
    cls = getattr(transformers, mt.model_class)
    torch.manual_seed(0)
    model = cls._from_config(cfg, dtype=torch.float32)
    _break_ties(model)
    return model.eval()


def _break_ties(model: torch.nn.Module) -> None:
    """Give every constant parameter (a router initialised to zeros, norms to
    ones) small random values around its constant.  A zero router scores every
    expert alike, and which of equal scores a top-k picks is an implementation
    detail (torch's CPU top-k of four equal values picks the last two, the
    card's the first two): the comparison is meant to find wrong values, not
    tie-breaking.  Fixed seed: every run builds the same model."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and p.dtype.is_floating_point and bool((p == p.flatten()[0]).all()):
                scale = max(float(p.flatten()[0].abs()), 1.0) * 0.05
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _inputs(model: torch.nn.Module, prompt: int = PROMPT) -> torch.Tensor:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(getattr(text, "vocab_size", 256) or 256)
    g = torch.Generator().manual_seed(1)
    # ids above the special tokens a tiny config moves to the top of the vocabulary
    return torch.randint(3, max(vocab - 16, 4), (1, prompt), generator=g)


def _out_tensor(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, tuple | list) and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the output tensor of {type(out).__name__}")


def _decode(model, ids, force=None):
    from torch_spyre.models.generate import generate

    return generate(model, ids, STEPS, keep_logits=True, force_tokens=force, bucket=16)


def _forward(model, ids) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(device))
    return _out_tensor(out).to("cpu", torch.float32)


@dataclass
class Reference:
    mode: str
    outputs: list[torch.Tensor]  # per step (decode) or one (forward)
    tokens: torch.Tensor | None = None


def reference(model, ids) -> Reference:
    """The CPU run; decode mode when the model runs through a static cache."""
    try:
        gen = _decode(model, ids)
        return Reference("decode", gen.logits, gen.tokens)
    except Exception:  # noqa: BLE001 - no static cache: compare one forward
        return Reference("forward", [_forward(model, ids)])


def _compare(ref: Reference, got: list[torch.Tensor], res: PathResult) -> None:
    diff, scale, wrong = 0.0, 0.0, 0
    for r, d in zip(ref.outputs, got, strict=True):
        r, d = r.float(), d.float()
        if r.shape != d.shape:
            raise AssertionError(f"shape {tuple(d.shape)} vs the CPU's {tuple(r.shape)}")
        if not torch.isfinite(d).all():
            diff = float("inf")
            continue
        step_diff = (d - r).abs().max().item()
        diff = max(diff, step_diff)
        scale = max(scale, r.abs().max().item())
        if ref.mode == "decode":
            wrong += int((d.argmax(-1) != r.argmax(-1)).sum())
    res.max_diff, res.scale, res.token_flips = diff, scale, wrong
    ok = diff <= ATOL + RTOL * scale and wrong == 0
    res.verdict = "match" if ok else "mismatch"


def run_path(ref_model, ref: Reference, ids, *, compile: bool) -> PathResult:
    """Prepare a copy for the card (eager or compiled), run it as the reference ran."""
    import torch_spyre
    from torch_spyre import models
    from torch_spyre.runtime import compiled as compiled_graphs

    res = PathResult()
    t0 = time.perf_counter()
    torch_spyre.reset_fallback_counts()
    before = compiled_graphs.loaded_degrade_steps()
    try:
        dev = models.prepare(copy.deepcopy(ref_model), compile=compile)
        if ref.mode == "decode":
            gen = _decode(dev, ids, force=ref.tokens)
            got = gen.logits
            res.modelled_ms_per_token = gen.decode_ms_per_token[0]
        else:
            got = [_forward(dev, ids)]
        _compare(ref, got, res)
    except Exception as e:  # noqa: BLE001 - the row records any failure
        res.verdict = "error"
        res.error = _short(e)
    res.fallback_ops = dict(torch_spyre.fallback_counts())
    res.host_fallbacks = sum(res.fallback_ops.values())
    # the steps of the graphs this run loaded, compiled now or taken from
    # Inductor's cache (a cached graph degrades as its compile did)
    after = compiled_graphs.loaded_degrade_steps()
    res.degraded = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    res.wall_s = time.perf_counter() - t0
    return res


def run_type(mt: ModelType, *, compile: bool = True, wide: bool = False) -> Row:
    """The row of one model type (``wide``: heads of 64, a 64-token prompt)."""
    import warnings

    row = Row(mt.name, mt.family)
    t0 = time.perf_counter()
    # a kernel that failed on the card for the type before put the card into
    # its stream error (as a real card: refused until reset); each type
    # starts on a working card
    torch.spyre.reset_device_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for variant in range(len(VARIANTS)):
            try:
                model = build(mt, variant, wide)
                row.params_m = sum(p.numel() for p in model.parameters()) / 1e6
                ids = _inputs(model, WIDE_PROMPT if wide else PROMPT)
                ref = reference(model, ids)
                break
            except Exception as e:  # noqa: BLE001 - the next variant, or a cpu-error row
                row.error = _short(e)
        else:
            row.status = "cpu-error"
            row.wall_s = time.perf_counter() - t0
            return row
        row.error = ""
        row.mode = ref.mode
        row.eager = run_path(model, ref, ids, compile=False)
        if compile:
            torch._dynamo.reset()
            row.compiled = run_path(model, ref, ids, compile=True)
            torch._dynamo.reset()
    row.wall_s = time.perf_counter() - t0
    return row
