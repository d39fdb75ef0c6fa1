"""Speculative decoding on the card: acceptance, steps and modelled time per token.

SmolLM2-135M through vLLM (in-process engine, greedy), each prompt alone
(batch 1), without speculation and with vLLM's n-gram proposer at each k, or
(``--draft-layers N``) with a draft model: SmolLM2's own first N layers
(embedding, final norm and tied head kept), a truncated copy written once
next to the cached checkpoint, run on the card beside the target.
Printed per prompt and k: the forward steps, drafted and accepted tokens
(vLLM's counters), the acceptance rate, the modelled card time per generated
token (the runner's StepStats over the run's steps, prefill included; with a
draft model the steps include its k forwards) and its ratio to the run
without speculation, and whether the tokens equal it.

    python benchmarks/spec_decode.py [--dtype float16] [--k 3,5] [--tokens 32]
    python benchmarks/spec_decode.py --draft-layers 8 --k 3
    python benchmarks/spec_decode.py --estimate [--acceptance 0.3,0.5,0.7,0.9]

``--estimate``: Granite-3.3-8B at batch 1 (``spyre estimate --spec``, no
weights: the acceptance rate is an input, e.g. the rates measured above on
SmolLM2), with n-gram k=3 and a 1.0 B-parameter draft (its own first 4
layers, embedding and LM head) at k=4: tokens per step, the verification
step, drafting, tokens/s and the ratio to decode without speculation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

#: the stated prompt set: tasks whose answer copies the prompt, the work
#: prompt lookup is for (lists, quoting a text, repeating code, extending a
#: table or JSON records, a repeated sentence); for each, SmolLM2's own greedy
#: continuation is what it is (``fox`` and ``records`` leave the pattern after
#: a few tokens) ...
PROMPTS = {
    "weekdays": "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
    "copy": "Text: The committee approved the budget for the new library, which will open in "
    "the spring with a reading room, a children's corner and a small cafe.\n"
    "The same text, copied exactly:\nText: The committee approved",
    "code": "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
    "# The same two functions again:\n\ndef area(width, height):\n",
    "csv": "name,city,country\nAlice,Paris,France\nBob,Paris,France\nCarol,Paris,France\n"
    "Dave,Paris,France\nEve,",
    "records": '{"name": "Alice", "age": 30}, {"name": "Bob", "age": 31}, '
    '{"name": "Carol", "age": 32}, {"name": "Dave",',
    "fox": "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
    "the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    # ... and one where it does not (the control, outside the set's figure)
    "open": "The capital of France is",
}
CONTROL = {"open"}


def set_rows(rows: list[dict]) -> list[dict]:
    """Per k, the repetitive set as one workload: every prompt of the set alone
    at batch 1, its tokens over its modelled card time (prefill included), and
    the acceptance over all its drafts."""
    out = []
    for k in sorted({r["k"] for r in rows}):
        rs = [r for r in rows if r["k"] == k and r["prompt"] not in CONTROL]
        tokens = sum(r["tokens"] for r in rs)
        secs = sum(r["modelled_ms_per_token"] * r["tokens"] for r in rs) / 1e3
        drafted = sum(r["drafted"] for r in rs)
        out.append(
            {"k": k, "prompts": len(rs), "tokens": tokens, "steps": sum(r["steps"] for r in rs),
             "drafted": drafted, "accepted": sum(r["accepted"] for r in rs),
             "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else None,
             "tokens_per_s": tokens / secs, "equal": all(r["equal"] for r in rs)}
        )  # fmt: skip
    base = out[0]["tokens_per_s"]
    for r in out:
        r["speedup"] = r["tokens_per_s"] / base
    return out


def _counters(llm) -> dict[str, float]:
    return {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
    }


def _steps(worker) -> list:
    return list(worker.model_runner.step_stats.history)


def truncated_copy(path: str, layers: int) -> str:
    """``path``'s first ``layers`` decoder layers as a checkpoint of its own
    (config, weights, tokenizer files), written once beside it."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src = Path(path)
    dst = src.parent / f"{src.name}-first{layers}"
    if (dst / "model.safetensors").exists():
        return str(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if layers >= cfg["num_hidden_layers"]:
        raise ValueError(f"--draft-layers {layers}: the model has {cfg['num_hidden_layers']}")
    cfg["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            kept[name] = t
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(dst)
    return str(dst)


def _spec(k: int, draft: str | None) -> dict | None:
    if not k:
        return None
    if draft is not None:
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }


def run(dtype: str, ks: list[int], tokens: int, draft_layers: int = 0) -> list[dict]:
    from vllm import LLM, SamplingParams

    from torch_spyre.models.offline import folder

    path = str(folder("smollm2"))
    draft = truncated_copy(path, draft_layers) if draft_layers else None
    method = f"draft {draft_layers}L" if draft else "ngram"
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rows, base = [], {}
    for k in [0, *ks]:
        spec = _spec(k, draft)
        llm = LLM(
            model=path, dtype=dtype, max_model_len=256, max_num_seqs=4,
            max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20, seed=0,
            enable_prefix_caching=False, speculative_config=spec, disable_log_stats=False,
        )  # fmt: skip
        try:
            for name, prompt in PROMPTS.items():
                h0, c0 = llm.collective_rpc(_steps)[0], _counters(llm)
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                h1, c1 = llm.collective_rpc(_steps)[0], _counters(llm)
                steps = h1[len(h0) :]
                got = list(out.outputs[0].token_ids)
                drafted = c1.get("vllm:spec_decode_num_draft_tokens", 0) - c0.get(
                    "vllm:spec_decode_num_draft_tokens", 0
                )
                accepted = c1.get("vllm:spec_decode_num_accepted_tokens", 0) - c0.get(
                    "vllm:spec_decode_num_accepted_tokens", 0
                )
                per_tok = sum(s for _, _, s in steps) / len(got)
                if k == 0:
                    base[name] = (got, per_tok)
                rows.append(
                    {
                        "prompt": name, "method": method if k else "-", "k": k,
                        "steps": len(steps), "tokens": len(got), "drafted": int(drafted),
                        "accepted": int(accepted),
                        "acceptance": accepted / drafted if drafted else None,
                        "modelled_ms_per_token": per_tok * 1e3,
                        "speedup": base[name][1] / per_tok,
                        "equal": got == base[name][0],
                    }
                )  # fmt: skip
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    return rows


def estimate_rows(acceptances: list[float]) -> list[dict]:
    from torch_spyre.models import estimate, spec_estimate

    name = "granite-3.3-8b"
    cfg = estimate.model_config(name)
    rows = []
    for method, k, draft in (("ngram", 3, None), ("draft_model", 4, "layers=4")):
        common = dict(spec_tokens=k)
        target = estimate.estimate(name, **common)
        d, label = (None, "")
        if draft:
            d, label = spec_estimate.draft_estimate(draft, name, cfg, common)
        for a in acceptances:
            plan = spec_estimate.plan(target, spec_estimate.SpecOptions(method, k, a), d, label)
            rows.append({"model": name, **plan.to_json()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--k", default="3,5", help="speculative tokens per step, comma-separated")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--draft-layers", type=int, default=0,
        help="speculate with a draft model: SmolLM2's first N layers (0: n-gram)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="a last line of JSON (the rows)")
    ap.add_argument("--estimate", action="store_true", help="Granite-3.3-8B, modelled")
    ap.add_argument("--acceptance", default="0.3,0.5,0.7,0.9")
    args = ap.parse_args()
    if args.estimate:
        rates = [float(x) for x in args.acceptance.split(",") if x.strip()]
        rows = estimate_rows(rates)
        print("\nGranite-3.3-8B fp16, batch 1, prompt 1024 (spyre estimate --spec), modelled")
        print(f"{'method':12s} {'k':>2s} {'accept':>6s} {'tok/step':>8s} {'verify ms':>9s} "
              f"{'draft ms':>8s} {'tok/s':>6s} {'vs decode':>9s}")  # fmt: skip
        for r in rows:
            print(
                f"{r['method']:12s} {r['k']:2d} {r['acceptance']:6.0%} {r['tokens_per_step']:8.2f}"
                f" {r['verify_s'] * 1e3:9.1f} {r['draft_s'] * 1e3:8.1f}"
                f" {r['tokens_per_s_per_request']:6.1f} {r['speedup']:8.2f}x"
            )
        print(f"decode without speculation: {rows[0]['decode_s'] * 1e3:.1f} ms per token")
        if args.json:
            print(json.dumps(rows))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_SPYRE_VLLM_LOG_STEPS", "0")
    ks = [int(x) for x in args.k.split(",") if x.strip()]
    rows = run(args.dtype, ks, args.tokens, args.draft_layers)
    print(f"\nSmolLM2-135M {args.dtype} on the card, batch 1, greedy, {args.tokens} tokens,")
    if args.draft_layers:
        print(f"draft model: SmolLM2's first {args.draft_layers} of 30 layers (greedy drafts); "
              "modelled card time per generated token (prefill and draft passes included)")  # fmt: skip
    else:
        print(
            "n-gram prompt_lookup 2..4; modelled card time per generated token (prefill included)"
        )
    print(f"{'prompt':9s} {'method':9s} {'k':>2s} {'steps':>5s} {'drafted':>7s} {'accepted':>8s} "
          f"{'accept':>7s} {'ms/token':>9s} {'tok/s':>7s} {'vs k=0':>7s}  equal")  # fmt: skip
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        ms = r["modelled_ms_per_token"]
        print(
            f"{r['prompt']:9s} {r['method']:9s} {r['k']:2d} {r['steps']:5d} {r['drafted']:7d} "
            f"{r['accepted']:8d} {acc:>7s} {ms:9.3f} {1e3 / ms:7.1f} {r['speedup']:6.2f}x  "
            f"{r['equal']}"
        )
    print(f"\nthe repetitive set ({', '.join(p for p in PROMPTS if p not in CONTROL)}), "
          "each prompt alone: its tokens over its modelled card time")  # fmt: skip
    print(f"{'k':>2s} {'tokens':>6s} {'steps':>5s} {'drafted':>7s} {'accepted':>8s} "
          f"{'accept':>7s} {'tok/s':>7s} {'vs k=0':>7s}  equal")  # fmt: skip
    for r in set_rows(rows):
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(
            f"{r['k']:2d} {r['tokens']:6d} {r['steps']:5d} {r['drafted']:7d} {r['accepted']:8d} "
            f"{acc:>7s} {r['tokens_per_s']:7.1f} {r['speedup']:6.2f}x  {r['equal']}"
        )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
