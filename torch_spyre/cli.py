"""The ``spyre`` command line.

    spyre validate MODEL [--steps N] [--prompts K] [--dtype fp16] [--compile] [--json out.json]
    spyre generate MODEL PROMPT [--max-new-tokens N] [--chat] [--sample] [--compare] [--compile]
    spyre estimate MODEL [--prompt N] [--new-tokens N] [--dtype fp16|fp8|int8] [--json out.json]

``validate`` exits 1 when a validation threshold is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _validate(args: argparse.Namespace) -> int:
    import torch

    import torch_spyre
    from torch_spyre import validation

    torch_spyre.set_fallback_policy("silent")  # still counted and reported
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    report = validation.validate(
        args.model,
        steps=args.steps,
        prompts=args.prompts,
        dtype=dtype,
        progress=not args.no_progress,
        compile=args.compile,
    )
    print(report.format())
    if args.json:
        report.save_json(args.json)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1


def _generate(args: argparse.Namespace) -> int:
    import copy

    import torch

    import torch_spyre
    from torch_spyre import models
    from torch_spyre.models.generate import generate, prompt_ids

    torch_spyre.set_fallback_policy("silent")  # still counted and reported
    tok = models.load_tokenizer(args.model)
    ref = models.load_reference(args.model, kind="causal-lm")
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    dev = models.prepare(
        copy.deepcopy(ref) if args.compare else ref, dtype=dtype, compile=args.compile
    )
    ids = prompt_ids(tok, args.prompt, chat=args.chat)
    kw = dict(eos_token_id=tok.eos_token_id, do_sample=args.sample, seed=args.seed)
    torch_spyre.reset_fallback_counts()
    out = generate(dev, ids, args.max_new_tokens, progress=not args.no_progress, **kw)
    print(tok.decode(out.tokens[0], skip_special_tokens=True))
    print(out.summary())
    print(f"host fallbacks: {sum(torch_spyre.fallback_counts().values())} calls")
    if args.compare:
        cpu = generate(ref, ids, args.max_new_tokens, **kw).tokens[0]
        got = out.tokens[0]
        n = min(len(cpu), len(got))
        same = int((cpu[:n] == got[:n]).sum())
        print(f"agreement with CPU fp32: {same}/{max(len(cpu), len(got))} tokens identical")
    return 0


#: ``spyre estimate --dtype``: the decoder layers' weight type (None: fp16 like the rest)
_WEIGHTS = {"fp16": None, "fp8": "float8_e4m3fn", "int8": "int8"}


def _estimate(args: argparse.Namespace) -> int:
    import json

    import torch

    import torch_spyre
    from torch_spyre.models import estimate

    torch_spyre.set_fallback_policy("silent")  # still counted and reported
    names = sorted(estimate.MODELS) if args.model == "all" else [args.model]
    results = []
    for name in names:
        wdt = _WEIGHTS[args.dtype]
        est = estimate.estimate(
            name,
            prompt=args.prompt,
            new_tokens=args.new_tokens,
            weights=None if wdt is None else getattr(torch, wdt),
        )
        print(est.format())
        print()
        results.append(est.to_json())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models ship offline (shared/models.md)
    parser = argparse.ArgumentParser(prog="spyre", description="torch-spyre tools")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="run a model on spyre and on the CPU and compare")
    v.add_argument("model", help="offline model name (e.g. smollm2, minilm) or a local folder")
    v.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt (causal LMs)")
    v.add_argument("--prompts", type=int, default=None, help="use the first K fixed prompts")
    v.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="device dtype")
    v.add_argument("--json", default=None, help="write the full report as JSON here")
    v.add_argument("--compile", action="store_true", help="spyre side through torch.compile")
    v.add_argument("--no-progress", action="store_true")
    v.set_defaults(func=_validate)
    g = sub.add_parser("generate", help="generate text on spyre (static KV cache)")
    g.add_argument("model", help="offline causal LM name (e.g. smollm2) or a local folder")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--sample", action="store_true", help="sample (seeded) instead of greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="device dtype")
    g.add_argument("--compare", action="store_true", help="also run on the CPU and compare")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (spyre backend)")
    g.add_argument("--no-progress", action="store_true")
    g.set_defaults(func=_generate)
    e = sub.add_parser(
        "estimate",
        help="plan a model too large to run here (public config, no weights) and model its time",
    )
    e.add_argument("model", help="granite-3.3-8b, qwen3-8b, gemma-3-27b, or all")
    e.add_argument("--prompt", type=int, default=1024, help="prefill tokens (batch 1)")
    e.add_argument(
        "--new-tokens", type=int, default=128, help="decode budget: sizes the static KV cache"
    )
    e.add_argument(
        "--dtype",
        choices=sorted(_WEIGHTS),
        default="fp16",
        help="decoder-layer weights: fp16, or 8-bit (fp8 e4m3 / int8, per-channel scales, "
        "dequantised in LX; activations, embedding and LM head stay fp16)",
    )
    e.add_argument("--json", default=None, help="write the estimate(s) as JSON here")
    e.set_defaults(func=_estimate)
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation chatter
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
