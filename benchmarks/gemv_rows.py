"""vLLM batched decode on the simulated card, by the executor's ``GEMV_ROWS``.

``sim/direct.py`` computes a weight matmul with the in-place kernel
(``_card.stick_gemm``) up to ``GEMV_ROWS`` rows of the other operand and with a
host GEMM on the re-laid weight above (``benchmarks/stick_gemm.py`` times the
two per matmul).  vLLM pads a step of up to 16 decoding requests to its
16-token bucket, so the threshold decides which path a batched decode takes.
This serves SmolLM2-135M (fp16, compiled) to 16 greedy requests in one
in-process engine and times ``generate`` with each threshold, alternating
them in one process (CPU time of the process, the least of ``--runs``), and
checks that the tokens are the same.  No modelled figure: both paths compute
the same products, and the card's time does not depend on the host path.

    python benchmarks/gemv_rows.py [--rows 8 16] [--runs 3] [--tokens 12]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_SPYRE_VLLM_LOG_STEPS", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from torch_spyre.models import offline
    from torch_spyre.sim import direct

    llm = LLM(
        model=str(offline.folder("smollm2")),
        dtype="float16",
        max_num_seqs=16,
        max_model_len=256,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    default = direct.GEMV_ROWS
    llm.generate(prompts, sp, use_tqdm=False)  # every bucket compiled and warm
    cpu: dict[int, list[float]] = {r: [] for r in args.rows}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(args.runs):
        for rows in args.rows:
            direct.GEMV_ROWS = rows  # read at every matmul
            t = time.process_time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            cpu[rows].append(time.process_time() - t)
            tokens[rows] = [list(o.outputs[0].token_ids) for o in outs]
    direct.GEMV_ROWS = default
    base = min(cpu[args.rows[0]])
    print(f"SmolLM2-135M fp16 compiled, 16 requests x {args.tokens} greedy tokens per generate")
    print(f"sim/direct.py GEMV_ROWS default = {default}")
    print(f"{'GEMV_ROWS':>9} {'CPU s (least)':>14} {'all runs':>22} {'ratio':>6}")
    for rows in args.rows:
        runs = " ".join(f"{t:.2f}" for t in cpu[rows])
        print(f"{rows:>9} {min(cpu[rows]):>14.2f} {runs:>22} {min(cpu[rows]) / base:>6.2f}")
    same = all(tokens[r] == tokens[args.rows[0]] for r in args.rows)
    print(f"same tokens with every threshold: {same}")


if __name__ == "__main__":
    main()
