"""``python -m torch_spyre.tools.archsweep``: every model type transformers
ships, tiny and random, on the card (eager and compiled) against the CPU.

    python -m torch_spyre.tools.archsweep                  # the full sweep (resumes)
    python -m torch_spyre.tools.archsweep --sample ci      # the CI sample
    python -m torch_spyre.tools.archsweep --types llama,olmoe --out /tmp/s.jsonl
    python -m torch_spyre.tools.archsweep --write-doc docs/models.md   # the table
    python -m torch_spyre.tools.archsweep --wide --out /tmp/wide.jsonl  # heads of 64, 64 tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch_spyre.tools.archsweep import sweep as sw
from torch_spyre.tools.archsweep import table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_spyre.tools.archsweep")
    p.add_argument("--types", help="comma-separated model types (default: every type)")
    p.add_argument("--sample", choices=["ci"], help="a fixed sample across families")
    p.add_argument("--out", default="archsweep.jsonl", help="results (JSON lines; resumed)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a type may take")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled path")
    p.add_argument("--write-doc", metavar="MD", help="write the table into this markdown file")
    p.add_argument("--list", action="store_true", help="list the model types and stop")
    p.add_argument(
        "--wide",
        action="store_true",
        help="heads of 64 and 64-token prompts (the shapes the attention fusions need)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    names = a.types.split(",") if a.types else None
    types = sw.selected(names, a.sample)
    if a.list:
        for m in types:
            print(f"{m.name:<28} {m.family:<10} {m.model_class}")
        return 0
    out = Path(a.out)
    if a.worker:
        sw.worker(types, out, Path(a.progress), compile=not a.eager_only, wide=a.wide)
        return 0
    rows = sw.sweep(
        types, out, jobs=a.jobs, timeout=a.timeout, compile=not a.eager_only, wide=a.wide
    )
    chosen = [rows[m.name] for m in types if m.name in rows]
    print("\n".join(table.totals(chosen).lines()))
    if a.write_doc:
        table.write_doc(chosen, Path(a.write_doc))
        print(f"wrote {a.write_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
