"""``python -m torch_spyre.tools.opcheck``: the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from torch_spyre.tools.opcheck.report import (
    failure_groups,
    format_table,
    render_markdown,
    totals,
    totals_lines,
)
from torch_spyre.tools.opcheck.results import OpResult
from torch_spyre.tools.opcheck.runners import run_in_process, run_in_workers
from torch_spyre.tools.opcheck.selection import (
    DEFAULT_DTYPES,
    QUICK_MAX_SAMPLES,
    QUICK_OPS,
    VARIANTS,
    load_op_db,
    select_ops,
)

DEFAULT_OUTPUT = Path("docs/op-coverage.md")

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtypes(text: str) -> list[torch.dtype]:
    out = []
    for name in text.split(","):
        name = name.strip().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {name!r}; use {', '.join(sorted(_DTYPE_NAMES))}"
            )
        out.append(_DTYPE_NAMES[name])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_spyre.tools.opcheck",
        description="Run PyTorch's OpInfo samples on spyre and on the CPU, compare, and "
        "report per op whether it runs as a device kernel, an adapter, the host fallback, "
        "or fails.",
    )
    p.add_argument(
        "--ops",
        help="comma-separated regexes; an op is kept if one matches its whole name or "
        "name[variant], e.g. 'add,nn\\.functional\\..*,max\\[binary\\]'",
    )
    p.add_argument(
        "--dtypes",
        type=parse_dtypes,
        default=list(DEFAULT_DTYPES),
        help="comma-separated dtypes (default: float32,float16)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a fast subset: {len(QUICK_OPS)} representative ops, "
        f"{QUICK_MAX_SAMPLES} samples per dtype",
    )
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="function",
        help="what to run: the op on its samples (default; the one the report and its "
        "totals are about), its in-place variant x.op_(...) for ops that have one, or the op "
        "on non-contiguous copies of the samples",
    )
    p.add_argument("--max-samples", type=int, help="at most this many samples per op and dtype")
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="worker processes (default 2); 0 runs in this process without crash protection",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one op may take (default 300)"
    )
    p.add_argument(
        "--output",
        type=Path,
        help=f"markdown report (default: {DEFAULT_OUTPUT} for a full run; "
        "filtered runs write one only when asked)",
    )
    p.add_argument("--json", type=Path, help="also write every result as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-op progress lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    ops = select_ops(load_op_db(), args.ops, args.quick, args.dtypes, args.variant)
    if not ops:
        print("no op matches", file=sys.stderr)
        return 2
    max_samples = args.max_samples or (QUICK_MAX_SAMPLES if args.quick else None)

    def progress(r: OpResult, done: int, total: int) -> None:
        if not args.quiet:
            print(
                f"[{done}/{total}] {r.key}: {r.path} {r.passed}/{r.samples} ({r.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    if args.jobs == 0:
        results = run_in_process(ops, args.dtypes, max_samples, progress)
    else:
        results = run_in_workers(ops, args.dtypes, max_samples, args.jobs, args.timeout, progress)
    elapsed = time.perf_counter() - start

    print(format_table(results))
    print()
    groups = failure_groups(results)
    if groups:
        print("failures by cause:")
        for cause, keys in groups.items():
            print(f"  {len(keys):3d}  {cause}\n       {', '.join(keys)}")
        print()
    for line in totals_lines(totals(results)):
        print(line)
    print(f"time: {elapsed:.1f} s for {len(ops)} ops")

    output = args.output
    # only the full, default run replaces the checked-in report
    full = not (args.ops or args.quick or args.max_samples) and args.variant == "function"
    if output is None and full and tuple(args.dtypes) == DEFAULT_DTYPES:
        output = DEFAULT_OUTPUT
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(render_markdown(results, args.dtypes))
        print(f"wrote {output}")
    if args.json is not None:
        data = [asdict(r) | {"key": r.key, "path": r.path} for r in results]
        args.json.write_text(json.dumps(data, indent=1))
    return 0
