"""Modelled decode at tensor parallel 1/2/4/8: tokens/s per request and per
system at batch 1 and 32, and the collectives' share (docs/distributed.md).

    python benchmarks/tp_decode.py [--prompt 512] [--new-tokens 128]

Each row is one ``spyre estimate`` plan (timing only, public configs)."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    "Granite-3.3-8B": "granite-3.3-8b",
    "Llama-3.1-70B": os.path.join(HERE, "..", "examples", "configs", "llama-3.1-70b.json"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--batch", default="1,32")
    args = ap.parse_args(argv)

    import torch_spyre
    from torch_spyre.models import estimate, parallel

    torch_spyre.set_fallback_policy("silent")
    print("| model | cards | batch | decode ms/token | tokens/s per request | tokens/s per system "
          "| collectives | fits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label in args.models.split(","):
        src = MODELS[label]
        cfg = parallel.load_config(src) if os.path.exists(src) else None
        for tp in (int(x) for x in args.tp.split(",")):
            for b in (int(x) for x in args.batch.split(",")):
                e = estimate.estimate(
                    src, prompt=args.prompt, new_tokens=args.new_tokens, config=cfg, tp=tp,
                    batch=b,
                )  # fmt: skip
                c = e.collective_s["decode"]
                print(
                    f"| {label} | {tp} | {b} | {e.decode_s * 1e3:.1f} | {1 / e.decode_s:.1f} | "
                    f"{b / e.decode_s:.1f} | {c * 1e3:.2f} ms ({100 * c / e.decode_s:.1f}%) | "
                    f"{'yes' if e.fits else e.fit_text()} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
