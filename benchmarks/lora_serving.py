"""Multi-LoRA overhead per decode step on the card (vLLM, modelled card time).

``python benchmarks/lora_serving.py [--ranks 8,16,64] [--adapters 1,4,16]
[--batch 16] [--targets all|qv] [--json F]``
``python benchmarks/lora_serving.py --estimate [--model granite-3.3-8b] [--batch 16] ...``

SmolLM2-135M (fp16, the offline model store) served by ``vllm.LLM`` on the
card.  For each rank, one engine with ``enable_lora`` (``max_loras`` = the
largest adapter count, ``max_lora_rank`` = the rank) serves a batch of
``--batch`` requests whose adapters are ``n`` distinct random peft adapters
(request ``i`` uses adapter ``i % n``); a second engine without LoRA serves the
same batch.  The figure is the median modelled card time of the decode steps
(every request decoding one token) and the LoRA overhead against the engine
without LoRA.  The row ``0`` adapters is the LoRA engine serving base-model
requests only (what ``--enable-lora`` costs a batch that uses no adapter).

``--estimate``: the same table for a model at ``spyre estimate`` scale
(Granite-3.3-8B by default; no weights, ``spyre estimate --lora N,rank``):
each decoder layer compiled with the LoRA op after every projection, the
batch's ``--batch`` decode tokens over N adapters (token t on adapter t mod N),
against the decode step without adapters (models/lora_estimate.py).

Adapters (peft ``LoraConfig``, random A and B) target every linear projection
(q, k, v, o, gate, up, down) with ``--targets all``, peft's default for
llama models (q and v) with ``qv``.  vLLM also wraps the embedding and the
LM head: their LoRA runs every step a batch has adapter tokens (with zero
weights, as these adapters have none there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_SPYRE_VLLM_LOG_STEPS", "0")

TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}
PROMPT_LEN = 8
DECODE_TOKENS = 6


def make_adapters(model_dir: str, rank: int, n: int, targets: list[str], root: Path) -> list[str]:
    """``n`` random peft adapters of rank ``rank`` saved under ``root``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    dirs = []
    for i in range(n):
        torch.manual_seed(1000 * rank + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        d = root / f"r{rank}_{i}"
        model.save_pretrained(d)
        dirs.append(str(d))
    return dirs


def engine(model_dir: str, batch: int, lora: tuple[int, int] | None, wrap: list[str] | None = None):
    from vllm import LLM

    extra: dict = {}
    if lora is not None:
        extra = dict(enable_lora=True, max_loras=lora[0], max_lora_rank=lora[1])
        if wrap is not None:
            extra["lora_target_modules"] = wrap
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=64,
        max_num_seqs=batch,
        max_num_batched_tokens=max(64, batch * PROMPT_LEN),
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        **extra,
    )


def decode_ms(llm, batch: int, requests: list) -> float:
    """Median modelled ms of the steps where all ``batch`` requests decode."""
    from vllm import SamplingParams

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)]}
               for i in range(batch)]  # fmt: skip
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, lora_request=requests, use_tqdm=False)  # compile, load
    first = len(runner.step_stats.history)
    llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    steps = [s for t, r, s in runner.step_stats.history[first:] if t == r == batch]
    if not steps:
        raise RuntimeError("no decode step with the whole batch")
    return statistics.median(steps) * 1e3


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def estimate_rows(model: str, batch: int, ranks: list[int], counts: list[int]) -> list[dict]:
    """``spyre estimate --lora N,rank`` for each rank and adapter count: the
    decode step with adapters against the step without them."""
    from torch_spyre.models import estimate
    from torch_spyre.models.lora_estimate import LoraOptions

    base = estimate.estimate(model, batch=batch)
    rows = []
    for rank in ranks:
        for n in counts:
            est = estimate.estimate(model, batch=batch, lora=LoraOptions(n, rank))
            base_ms, ms = (est.decode_s - est.lora_s) * 1e3, est.decode_s * 1e3
            assert abs(base_ms - base.decode_s * 1e3) < 1e-6, (base_ms, base.decode_s)
            rows.append(
                {"model": model, "rank": rank, "adapters": n, "batch": batch, "base_ms": base_ms,
                 "lora_ms": ms, "overhead": ms / base_ms - 1}
            )  # fmt: skip
            print(f"rank {rank:3d}  adapters {n:2d}  decode step {ms:8.3f} ms  "
                  f"(no LoRA {base_ms:.3f} ms)  overhead {100 * (ms / base_ms - 1):5.1f}%",
                  flush=True)  # fmt: skip
    return rows


def _table(rows: list[dict]) -> None:
    print("| rank | adapters in batch | decode step, no LoRA (ms) | with LoRA (ms) | overhead |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rank']} | {r['adapters']} | {r['base_ms']:.3f} | {r['lora_ms']:.3f} "
            f"| {100 * r['overhead']:.1f}% |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument(
        "--wrap",
        choices=("all", "targets"),
        default="all",
        help="LoRA layers vLLM builds: every linear layer (vLLM's default) or only the "
        "adapters' targets (--lora-target-modules)",
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--estimate", action="store_true", help="spyre estimate --lora, modelled")
    ap.add_argument("--model", default="granite-3.3-8b", help="with --estimate")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(n) for n in args.adapters.split(",")]
    if max(counts) > args.batch:
        raise SystemExit(f"--batch {args.batch} holds fewer requests than {max(counts)} adapters")
    if args.estimate:
        rows = estimate_rows(args.model, args.batch, ranks, counts)
        print(f"\n{args.model} fp16, batch {args.batch} decoding, adapters on every projection "
              "(spyre estimate --lora, modelled)")  # fmt: skip
        _table(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return

    from vllm.lora.request import LoRARequest

    from torch_spyre.models.offline import folder

    model = str(folder("smollm2"))

    llm = engine(model, args.batch, None)
    base_ms = decode_ms(llm, args.batch, [None] * args.batch)
    close(llm)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ranks:
            dirs = make_adapters(model, rank, max(counts), TARGETS[args.targets], Path(tmp))
            wrap = None if args.wrap == "all" else TARGETS[args.targets]
            llm = engine(model, args.batch, (max(counts), rank), wrap)
            reqs = [LoRARequest(f"r{rank}_{i}", 1 + i, d) for i, d in enumerate(dirs)]
            for n in [0, *counts]:
                batch = [None if n == 0 else reqs[i % n] for i in range(args.batch)]
                ms = decode_ms(llm, args.batch, batch)
                rows.append(
                    {"rank": rank, "adapters": n, "batch": args.batch, "targets": args.targets,
                     "wrap": args.wrap, "base_ms": base_ms, "lora_ms": ms,
                     "overhead": ms / base_ms - 1}
                )  # fmt: skip
                print(
                    f"rank {rank:3d}  adapters {n:2d}  decode step {ms:7.3f} ms  "
                    f"(no LoRA {base_ms:.3f} ms)  overhead {100 * (ms / base_ms - 1):5.1f}%",
                    flush=True,
                )
            close(llm)
    print()
    print(
        f"SmolLM2-135M fp16, batch {args.batch}, adapters on {args.targets} projections, "
        f"LoRA layers on {'every linear layer' if args.wrap == 'all' else 'their targets'}"
    )
    _table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
