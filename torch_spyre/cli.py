"""The ``spyre`` command line.

    spyre validate MODEL [--steps N] [--prompts K] [--dtype fp16] [--compile] [--json out.json]
    spyre generate MODEL PROMPT [--max-new-tokens N] [--chat] [--sample] [--compare] [--compile]
    spyre estimate MODEL|config.json|FOLDER [--batch B] [--token-budget T] [--explain] [--spec METHOD,k,a [--draft D]] [--lora N,r] [--prompt N] [--new-tokens N] [--tp N]
                   [--dtype fp16|fp8|int8] [--json out.json]
    spyre estimate MODEL --serve --rate R[,R2,...] --input-len I --output-len O [--tp N]
                   [--batch MAX_SEQS] [--requests K] [--plot out.png] [--json out.json]

    spyre cache --info | --clear

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


def _option(parse, text: str | None):
    """``parse(text)`` for a given option (None when absent); a bad one exits
    naming what is wrong."""
    if not text:
        return None
    try:
        return parse(text)
    except ValueError as e:
        raise SystemExit(f"spyre estimate: {e}") from None


def _estimate(args: argparse.Namespace) -> int:
    import json

    import torch

    import torch_spyre
    from torch_spyre.models import estimate, parallel

    torch_spyre.set_fallback_policy("silent")  # still counted and reported
    wdt = _WEIGHTS[args.dtype]
    weights = None if wdt is None else getattr(torch, wdt)
    if os.path.exists(args.model):  # a config.json or a checkpoint folder
        cfg = parallel.load_config(args.model)
        names = [args.model]
    else:
        cfg = None
        names = sorted(estimate.MODELS) if args.model == "all" else [args.model]
    from torch_spyre.models import lora_estimate, spec_estimate

    spec = _option(spec_estimate.SpecOptions.parse, args.spec)
    if (spec is not None and spec.method == "draft_model") != bool(args.draft):
        raise SystemExit(
            "spyre estimate: --draft (a model, a config.json, or layers=N) goes with "
            "--spec draft_model,k,acceptance, and only with it"
        )
    lora = _option(lora_estimate.LoraOptions.parse, args.lora)
    if args.serve:
        return _serve_plan(args, names[0], cfg, weights, spec, lora)
    results = []
    for name in names:
        common = dict(
            prompt=args.prompt,
            new_tokens=args.new_tokens,
            weights=weights,
            batch=args.batch,
            tp=args.tp,
            token_budget=args.token_budget,
            spec_tokens=spec.k if spec else 0,
            lora=lora,
        )
        try:
            est = estimate.estimate(name, config=cfg, **common)
            if spec is not None:
                draft, label = (None, "")
                if spec.method == "draft_model":
                    target_cfg = cfg if cfg is not None else estimate.model_config(name)
                    draft, label = spec_estimate.draft_estimate(
                        args.draft, name, target_cfg, common
                    )
                sp = spec_estimate.plan(est, spec, draft, label)
        except NotImplementedError as e:  # a split or shape the estimator does not model
            raise SystemExit(f"spyre estimate {name}: {e}") from None
        except ValueError as e:
            raise SystemExit(f"spyre estimate {name}: {e}") from None
        print(est.format())
        if spec is not None:
            print(sp.format())
        if args.explain:
            print(est.explain())
        print()
        results.append(est.to_json())
        if spec is not None:
            results[-1]["speculation"] = sp.to_json()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _serve_plan(args: argparse.Namespace, name: str, cfg, weights, spec=None, lora=None) -> int:
    import json

    from torch_spyre.models import estimate, serve_plan

    if cfg is None:
        cfg = estimate.model_config(name)
    rates = [float(r) for r in str(args.rate).split(",") if r.strip()]
    if not rates:
        raise SystemExit("--serve needs --rate R (requests/s; R1,R2,... for a sweep)")
    batch = args.batch if args.batch > 1 else 32
    common = dict(prompt=args.input_len, new_tokens=args.output_len, weights=weights,
                  config=cfg, tp=args.tp)  # fmt: skip
    print(f"planning {name} at batch 1 and {batch} on {args.tp} card(s) ...", flush=True)
    common["spec_tokens"] = spec.k if spec is not None else 0
    common["lora"] = lora
    one = estimate.estimate(name, batch=1, **common)
    many = estimate.estimate(name, batch=batch, **common)
    if not many.fits:
        raise SystemExit(f"{name} at batch {batch}: {many.fit_text()}")
    draft_s = (0.0, 0.0)
    if spec is not None and spec.method == "draft_model":
        from torch_spyre.models import spec_estimate

        drafted = []
        for b in (1, batch):
            kw = {**common, "batch": b}
            kw.pop("config")
            try:
                d, label = spec_estimate.draft_estimate(args.draft, name, cfg, kw)
            except ValueError as e:
                raise SystemExit(f"spyre estimate {name}: {e}") from None
            drafted.append(spec_estimate.plan(many if b > 1 else one, spec, d, label).draft_s)
        draft_s = (drafted[0], drafted[1])
    if spec is not None:
        print(
            f"  speculation: {spec.method}, k={spec.k}, acceptance {spec.acceptance:.2f}"
            f" per draft token; drafting {draft_s[0] * 1e3:.1f} ms per step at batch 1,"
            f" {draft_s[1] * 1e3:.1f} ms at batch {batch}"
        )
    plans = []
    for r in rates:
        shown = [-1]

        def bar(done: int, total: int, r=r, shown=shown) -> None:
            if args.no_progress or done == shown[0]:
                return
            shown[0] = done
            filled = 30 * done // total
            print(f"\r  rate {r:g}/s [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}",
                  end="" if done < total else "\n", flush=True)  # fmt: skip

        plans.append(
            serve_plan.plan(
                one,
                many,
                cfg,
                rate=r,
                input_len=args.input_len,
                output_len=args.output_len,
                requests=args.requests,
                progress=bar,
                speculation=spec,
                draft_s=draft_s,
            )  # fmt: skip
        )
        print(plans[-1].format())
    if args.json:
        with open(args.json, "w") as f:
            f.write(serve_plan.dumps(plans) if len(plans) > 1 else json.dumps(plans[0].to_json()))
        print(f"wrote {args.json}")
    if args.plot:
        serve_plan.sweep_plot(plans, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _cache(args: argparse.Namespace) -> int:
    from torch_spyre.runtime import artifact_cache

    base = artifact_cache.root()
    if base is None:
        print("the artifact cache is off (TORCH_SPYRE_CACHE_DIR=off)")
        return 0
    if args.clear:
        freed = artifact_cache.clear(base)
        print(f"cleared {base}: {_size(freed)} freed")
        return 0
    from torch_spyre import settings

    info = artifact_cache.usage(base)
    cap = settings.get().cache_size
    print(f"artifact cache: {base}")
    print(
        f"  {_size(info['bytes'])} in {info['files']} files "
        f"(cap {_size(cap)}, TORCH_SPYRE_CACHE_SIZE)"
    )
    print(f"  code version {artifact_cache.code_version()}")
    for part, n in sorted(info["parts"].items()):
        print(f"  {part:28} {_size(n['bytes']):>12} {n['files']:7} files")
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor and os.path.abspath(inductor) != str(base / artifact_cache.INDUCTOR):
        print(f"  Inductor's cache is elsewhere (TORCHINDUCTOR_CACHE_DIR={inductor})")
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
    e.add_argument(
        "model",
        help="granite-3.3-8b, qwen3-8b, gemma-3-27b, gemma-4-26b-a4b, all, or a transformers "
        "config.json / folder",
    )
    e.add_argument("--prompt", type=int, default=1024, help="prefill tokens per request")
    e.add_argument("--batch", type=int, default=1, help="requests per step (--serve: max seqs)")
    e.add_argument(
        "--spec",
        help="decode with speculation: METHOD,k,acceptance (ngram or draft_model; acceptance"
        " per draft token, e.g. ngram,3,0.7)",
    )
    e.add_argument(
        "--lora",
        help="decode steps with LoRA: N,rank (N resident adapters over the batch's tokens)",
    )
    e.add_argument(
        "--draft",
        help="--spec draft_model: the draft (a model, a config.json, or layers=N: the"
        " target's first N layers)",
    )
    e.add_argument(
        "--explain",
        action="store_true",
        help="each kernel as planned: time against its roofline, utilisation, core grid, tiles",
    )
    e.add_argument(
        "--token-budget",
        type=int,
        default=2048,
        help="tokens one prefill step packs (vLLM's max_num_batched_tokens; vllm serve's default)",
    )
    e.add_argument("--tp", type=int, default=1, help="cards, tensor parallel (1..8)")
    e.add_argument("--serve", action="store_true", help="a serving plan (vLLM's scheduler)")
    e.add_argument("--rate", default=None, help="--serve: requests/s (R1,R2,... to sweep)")
    e.add_argument("--input-len", type=int, default=1024, help="--serve: prompt tokens")
    e.add_argument("--output-len", type=int, default=128, help="--serve: new tokens")
    e.add_argument("--requests", type=int, default=200, help="--serve: requests simulated")
    e.add_argument("--plot", default=None, help="--serve: throughput vs rate PNG")
    e.add_argument("--no-progress", action="store_true")
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
    c = sub.add_parser(
        "cache", help="the persistent compiled-artifact cache (TORCH_SPYRE_CACHE_DIR)"
    )
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--info", action="store_true", help="where it is, its size and parts")
    what.add_argument("--clear", action="store_true", help="empty it (ours and Inductor's)")
    c.set_defaults(func=_cache)
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation chatter
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
