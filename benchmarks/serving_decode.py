"""Modelled decode step of vLLM on the card against its memory floor.

One run: SmolLM2-135M in fp16 through vLLM (in-process engine), 16 requests
whose prompts are ``--context`` tokens, then decode steps of all 16 at once.
The card is timed, not executed (``TORCH_SPYRE_TIMING_ONLY``: programs are
planned and timed exactly as in a real run, no numbers computed), so a 2k
context runs here in seconds.  Printed per decode step: the modelled time, the
floor -- every weight byte and every cached key/value byte of the batch read
once from LPDDR5 -- at the calibrated sustained bandwidth (the kernels'
roof) and at the 204.8 GB/s peak, and the ratio.

    python benchmarks/serving_decode.py [--context 1536] [--batch 16] [--eager]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="TORCH_SPYRE_VLLM_COMPILE=0")
    ap.add_argument("--profile", action="store_true", help="kernel table of the decode steps")
    ap.add_argument("--json", action="store_true", help="a last line of JSON (the rows)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCH_SPYRE_VLLM_LOG_STEPS", "0")
    os.environ["TORCH_SPYRE_TIMING_ONLY"] = "1"
    if args.eager:
        os.environ["TORCH_SPYRE_VLLM_COMPILE"] = "0"
    else:  # decode buckets only: the prefill runs in chunks of the largest
        os.environ.setdefault("TORCH_SPYRE_VLLM_BUCKETS", "16,512")
    import torch
    from vllm import LLM, SamplingParams

    from torch_spyre.models.offline import folder
    from torch_spyre.runtime import cards

    path = str(folder("smollm2"))
    llm = LLM(
        model=path, dtype="float16", max_model_len=args.context + 64,
        max_num_seqs=args.batch, max_num_batched_tokens=512, enable_prefix_caching=True,
        kv_cache_memory_bytes=int(1.2 * args.batch * (args.context + 64) * 23040) + (16 << 20),
        skip_tokenizer_init=True, seed=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(5, 40000, (args.context,), generator=g).tolist()}
        for _ in range(args.batch)
    ]
    # Prefill every prompt first (vLLM decodes the first requests while it
    # prefills the later ones), then decode all of them together: the second
    # call finds the prompts in the prefix cache and only decodes.
    from torch_spyre.profiler import profile

    for max_tokens in (1, args.steps + 2):
        if max_tokens > 1:
            first = len(llm.collective_rpc(lambda w: list(w.model_runner.step_stats.history))[0])
        with profile() as prof:
            llm.generate(
                prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )  # fmt: skip
    if args.profile:  # the decode call (the in-process engine's kernels)
        print(prof.table())

    def state(worker):
        r = worker.model_runner
        params = sum(p.numel() * p.element_size() for p in r.model.parameters())
        return {"history": list(r.step_stats.history), "weights": params}

    st = llm.collective_rpc(state)[0]
    cfg = llm.llm_engine.model_config.hf_config
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
    kv_per_token *= (cfg.hidden_size // cfg.num_attention_heads) * 2
    hw = cards.config(0)
    decodes = [
        (t, r, s) for t, r, s in st["history"][first:] if t == args.batch and r == args.batch
    ]
    mode = "eager" if args.eager else "compiled"
    print(f"SmolLM2-135M fp16, vLLM ({mode}), batch {args.batch}, context {args.context}")
    print(f"{'step':>4}{'context':>9}{'modelled ms':>13}{'floor ms (sust.)':>18}"
          f"{'floor ms (peak)':>17}{'ratio':>8}")  # fmt: skip
    worst = 0.0
    rows = []
    for i, (_, _, s) in enumerate(decodes[: args.steps]):
        ctx = args.context + 1 + i
        nbytes = st["weights"] + args.batch * ctx * kv_per_token
        sust = nbytes / hw.sustained_bandwidth_Bps
        peak = nbytes / hw.memory_bandwidth_Bps
        worst = max(worst, s / sust)
        rows.append({"context": ctx, "modelled_s": s, "floor_s": sust, "ratio": s / sust})
        print(f"{i:>4}{ctx:>9}{s * 1e3:>13.3f}{sust * 1e3:>18.3f}{peak * 1e3:>17.3f}"
              f"{s / sust:>7.2f}x")  # fmt: skip
    print(f"worst ratio to the sustained floor: {worst:.2f}x (target <= 1.3x)")
    if args.json:
        kernels = sorted({k.name for k in prof.kernels if k.name.startswith("flash_attn")})
        print(json.dumps({"rows": rows, "attention_kernels": kernels}))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
