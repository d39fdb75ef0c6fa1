"""Main job: chat with SmolLM2-135M-Instruct on the simulated spyre card, compiled.

The stock Hugging Face model is adapted for the card (``torch_spyre.models``),
moved to ``spyre`` in fp16 and compiled with plain ``torch.compile`` (the
spyre Inductor backend: one graph for the prompt bucket, one for decoding).
It answers a question greedily; the same model answers on the CPU in fp32
and the two answers are compared token by token.  Printed: the answer, the
modelled device time (prefill, and per generated token) next to wall time,
host fallbacks, and the agreement with the CPU.

    python examples/chat.py ["your question"] [--max-new-tokens N] [--dtype fp32] [--eager]
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import torch_spyre  # noqa: E402
from torch_spyre import models  # noqa: E402
from torch_spyre.models.generate import generate, prompt_ids  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default=QUESTION)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16")
    ap.add_argument("--eager", action="store_true", help="op by op instead of compiled")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32

    tok = models.load_tokenizer("smollm2")
    ref = models.load_reference("smollm2", kind="causal-lm")
    dev = models.prepare(copy.deepcopy(ref), dtype=dtype, compile=not args.eager)
    ids = prompt_ids(tok, args.question)
    kw = dict(eos_token_id=tok.eos_token_id)

    torch_spyre.set_fallback_policy("silent")  # counted and printed below
    torch_spyre.reset_fallback_counts()
    wall = time.perf_counter()
    out = generate(dev, ids, args.max_new_tokens, **kw)
    wall = time.perf_counter() - wall
    cpu = generate(ref, ids, args.max_new_tokens, **kw).tokens[0]
    got = out.tokens[0]

    mode = "eager" if args.eager else "compiled"
    print(f"SmolLM2-135M-Instruct on the simulated spyre card ({mode}, {args.dtype})")
    print(f"user: {args.question}")
    print(f"assistant: {tok.decode(got, skip_special_tokens=True).strip()}")
    print()
    mod_ms, _ = out.decode_ms_per_token
    print(
        f"prefill ({out.prefill_tokens} tokens): modelled {out.prefill_modelled_s * 1e3:.2f} ms "
        f"on the card (wall {out.prefill_wall_s:.1f} s here, compiling included)"
    )
    # the first decode step compiles the decode graph; the rest show the simulator's pace
    steady = sorted(out.decode_wall_s[1:]) or out.decode_wall_s
    wall_ms = 1e3 * steady[len(steady) // 2] if steady else 0.0
    print(
        f"decode: modelled {mod_ms:.3f} ms per token on the card (simulated here at "
        f"{wall_ms:.0f} ms wall per token); {len(got)} tokens in {wall:.1f} s wall in all"
    )
    n = min(len(cpu), len(got))
    first = next((i for i in range(n) if cpu[i] != got[i]), None)
    same = int((cpu[:n] == got[:n]).sum())
    print(
        f"agreement with CPU fp32: {same}/{max(len(cpu), len(got))} tokens identical"
        + ("" if first is None else f" (first difference at token {first})")
    )
    falls = torch_spyre.fallback_counts()
    print(f"host fallbacks: {sum(falls.values())} calls {dict(falls) if falls else ''}")
    print(
        f"device memory: {torch.spyre.memory_allocated() / 2**20:.0f} MiB in use, "
        f"peak {torch.spyre.max_memory_allocated() / 2**20:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raise SystemExit(main())
