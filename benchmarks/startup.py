"""Start-up time of vLLM on the card against depth: one graph or piece by piece.

``python benchmarks/startup.py [--depths 2,8,40] [--smollm2] [--json F]``

For each model, ``vllm.LLM(...)`` is started in a fresh process twice with
one Inductor cache directory: **cold** (the directory empty) and **warm**
(filled by the cold run), once with the forward compiled as one graph per
token bucket (``TORCH_SPYRE_VLLM_PIECEWISE=0``) and once piece by piece
between attention ops, each distinct piece compiled once (the default,
``compiler/piecewise.py``).  The start-up compiles every bucket (16 and the
token budget, 64 here).  Each run then answers one 8-token request; its
modelled card time is printed beside (deterministic: the two modes must run
the same or fewer card cycles) and its tokens compared.

The models: a Granite-shaped decoder at small width (GraniteForCausalLM:
hidden 256, 4 heads, 2 KV heads, MLP 512, its residual and logit
multipliers) at each depth, random weights built here; with ``--smollm2``
SmolLM2-135M from the offline model store (30 layers).

Wall-clock figures depend on the machine's load; compare the two modes in
the same run.  Not measured here: Inductor's CPU backend on the same graphs
(issue 30 asks for it), and a ``vllm serve`` ready time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from vllm import LLM, SamplingParams
path, dtype = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
          max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20, seed=0)
up = time.perf_counter() - t0
clock = torch.spyre.modelled_time_s()
out = llm.generate([{"prompt_token_ids": [1, 5, 9, 23, 42, 77, 101, 7]}],
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
modelled = torch.spyre.modelled_time_s() - clock
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
s = runner.compiled.summary()
print("STARTUP " + json.dumps({
    "up_s": up, "compile_s": sum(s["compile_s"].values()), "pieces": s["pieces"],
    "modelled_ms": modelled * 1e3, "tokens": list(out[0].outputs[0].token_ids),
}))
"""


def granite(depth: int, root: Path) -> str:
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    path = root / f"granite_{depth}"
    if not path.exists():
        torch.manual_seed(0)
        cfg = GraniteConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=depth,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True, residual_multiplier=0.22, embedding_multiplier=12.0,
            logits_scaling=8.0, attention_multiplier=0.0078125,
        )  # fmt: skip
        GraniteForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def run(path: str, dtype: str, piecewise: bool, cache: str) -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TORCH_SPYRE_VLLM_PIECEWISE": "1" if piecewise else "0",
        "TORCH_SPYRE_VLLM_LOG_STEPS": "0",
    }
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, path, dtype],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if line is None:
        raise RuntimeError(f"{path} (piecewise={piecewise}) failed:\n{p.stderr[-3000:]}")
    out = json.loads(line.removeprefix("STARTUP "))
    out["process_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="2,8,40")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (offline store)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="spyre_startup_") as tmp:
        models = [(f"granite x{d}", granite(int(d), Path(tmp)), "float16")
                  for d in args.depths.split(",")]  # fmt: skip
        if args.smollm2:
            from torch_spyre.models.offline import folder

            models.append(("SmolLM2-135M", str(folder("smollm2")), "float16"))
        for name, path, dtype in models:
            for piecewise in (False, True):
                cache = tempfile.mkdtemp(prefix="inductor_", dir=tmp)
                cold = run(path, dtype, piecewise, cache)
                warm = run(path, dtype, piecewise, cache)
                rows.append({"model": name, "piecewise": piecewise, "cold": cold, "warm": warm})
                print(
                    f"{name:14} {'pieces' if piecewise else 'whole ':6} cold {cold['up_s']:6.1f} s "
                    f"warm {warm['up_s']:6.1f} s  pieces {cold['pieces']}  "
                    f"{cold['modelled_ms']:.3f} ms modelled",
                    flush=True,
                )
    print()
    print(
        "| model | mode | engine up cold (s) | warm (s) | compile cold (s) | pieces compiled / reused | modelled ms, 8 tokens | same tokens |"
    )  # noqa: E501
    print("|---|---|---|---|---|---|---|---|")
    whole = {r["model"]: r for r in rows if not r["piecewise"]}
    for r in rows:
        c, pcs = r["cold"], r["cold"]["pieces"]
        same = c["tokens"] == whole[r["model"]]["cold"]["tokens"]
        mode = "piece by piece" if r["piecewise"] else "one graph"
        pieces = f"{pcs['compiled']} / {pcs['reused']}" if r["piecewise"] else "-"
        print(
            f"| {r['model']} | {mode} | {c['up_s']:.1f} | {r['warm']['up_s']:.1f} | "
            f"{c['compile_s']:.1f} | {pieces} | {c['modelled_ms']:.3f} | {'yes' if same else 'NO'} |"
        )
    depths = [r for r in rows if r["piecewise"] and r["model"].startswith("granite")]
    if len(depths) >= 2:
        lo, hi = depths[0], depths[-1]
        print(
            f"\npiece by piece, cold compile: {hi['model']} {hi['cold']['compile_s']:.1f} s against "
            f"{lo['model']} {lo['cold']['compile_s']:.1f} s "
            f"({hi['cold']['compile_s'] / lo['cold']['compile_s']:.2f}x; issue 30's bar: 1.5x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
