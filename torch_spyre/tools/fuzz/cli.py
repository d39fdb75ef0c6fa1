"""``python -m torch_spyre.tools.fuzz``: fuzz for N minutes, minimise every failure.

Graphs are generated from consecutive seeds and run in batches (``--batch``
graphs merged into one compile) in a worker process, so that a crash of the
process is recorded as a ``crash`` of its batch rather than ending the run.
Every failing graph is minimised (``minimiser.py``) in this process and
written as a pytest file under ``--cases`` (one per distinct failure; the same
failure again is counted, not re-minimised).  The summary gives the counts of
each outcome, the degrade steps and host fallbacks the compiled graphs took,
and graphs per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from torch_spyre.tools.fuzz.generator import BLOCKS, CI, LONG, ROUTING, generate

CONFIGS = {"blocks": BLOCKS, "ci": CI, "long": LONG, "routing": ROUTING}
DEFAULT_CASES = Path("tests/compiler/fuzz_cases")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_spyre.tools.fuzz", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    p.add_argument("--seed", type=int, default=0, help="first graph seed (default 0)")
    p.add_argument("--graphs", type=int, default=None, help="stop after this many graphs")
    p.add_argument(
        "--batch", type=int, default=8, help="graphs merged into one compile (default 8)"
    )
    p.add_argument(
        "--config", choices=sorted(CONFIGS), default="long", help="graph sizes (default long)"
    )
    p.add_argument(
        "--cases", type=Path, default=DEFAULT_CASES, help="where minimised failures are written"
    )
    p.add_argument(
        "--no-minimise", action="store_true", help="record failures without minimising them"
    )
    p.add_argument(
        "--minimise-budget", type=float, default=180.0, help="seconds per failure (default 180)"
    )
    p.add_argument(
        "--in-process", action="store_true", help="no worker process (a crash ends the run)"
    )
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="compile with dynamic=True (every size symbolic, as automatic dynamic "
        "shapes makes them when a size changes)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


# ---- the worker --------------------------------------------------------------------------


def _run_batch(seeds: list[int], config: str, dynamic: bool = False) -> list[dict]:
    from torch_spyre.tools.fuzz.runner import check_many, quiet

    quiet()
    graphs = [generate(s, CONFIGS[config]) for s in seeds]
    results, _ = check_many(graphs, seed=seeds[0], dynamic=dynamic)
    return [asdict(r) for r in results]


def _worker(conn, config: str, dynamic: bool) -> None:
    while True:
        seeds = conn.recv()
        if seeds is None:
            return
        conn.send(_run_batch(seeds, config, dynamic))


class Worker:
    """A child process running batches; restarted when it dies."""

    def __init__(self, config: str, timeout: float = 600.0, dynamic: bool = False) -> None:
        self.config, self.timeout, self.dynamic = config, timeout, dynamic
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_worker, args=(child, self.config, self.dynamic), daemon=True
        )
        self.proc.start()

    def run(self, seeds: list[int]) -> list[dict]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(seeds)
        if self.conn.poll(self.timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        self.proc.kill()
        self.proc.join()
        code = self.proc.exitcode
        self.proc = None
        why = (
            f"worker process died (exit code {code})"
            if code not in (None, -9)
            else "worker timed out"
        )
        return [{"status": "crash", "detail": why} for _ in seeds]

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)


# ---- the main loop ---------------------------------------------------------------------------


def _signature(status: str, detail: str) -> str:
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", detail)
    text = re.sub(r"buf\w+|op\w+|arg\w+", "X", text)
    return f"{status}: {text[:120]}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = (lambda *_: None) if args.quiet else (lambda *a: print(*a, flush=True))
    from torch_spyre.tools.fuzz.minimiser import minimise, same_failure, write_case
    from torch_spyre.tools.fuzz.runner import check, quiet

    quiet()
    worker = None if args.in_process else Worker(args.config, dynamic=args.dynamic)
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    seed = args.seed
    totals: Counter[str] = Counter()
    degraded: Counter[str] = Counter()
    host = ratio_max = 0.0
    seen: dict[str, dict] = {}
    failures = []
    ran = 0
    try:
        while time.monotonic() < deadline and (args.graphs is None or ran < args.graphs):
            n = args.batch if args.graphs is None else min(args.batch, args.graphs - ran)
            seeds = list(range(seed, seed + n))
            seed += n
            results = worker.run(seeds) if worker else _run_batch(seeds, args.config, args.dynamic)
            ran += n
            for s, r in zip(seeds, results):
                totals[r["status"]] += 1
                degraded.update(r.get("degraded", {}))
                host += r.get("host_fallbacks", 0)
                ratio_max = max(ratio_max, r.get("ratio", 0.0))
                if r["status"] == "pass":
                    continue
                sig = _signature(r["status"], r["detail"])
                entry = {"seed": s, "status": r["status"], "detail": r["detail"], "signature": sig}
                failures.append(entry)
                say(f"seed {s}: {r['status']}: {r['detail'][:300]}")
                if sig in seen:
                    seen[sig]["count"] += 1
                    continue
                seen[sig] = {**entry, "count": 1}
                if args.no_minimise or r["status"] == "crash" and "worker" in r["detail"]:
                    continue
                g = generate(s, CONFIGS[args.config])
                first = check(g, dynamic=args.dynamic)
                if not first.failed:
                    seen[sig]["case"] = "fails only merged with other graphs (not minimised)"
                    continue
                say(f"  minimising seed {s} ({g.describe()})")
                small = minimise(
                    g,
                    lambda c, first=first: same_failure(check(c, dynamic=args.dynamic), first),
                    budget_s=args.minimise_budget,
                    log=say,
                )
                kind = f"{first.status}_dynamic" if args.dynamic else first.status
                path = write_case(
                    small,
                    check(small, dynamic=args.dynamic),
                    args.cases / f"test_fuzz_{kind}_{s}.py",
                    dynamic=args.dynamic,
                )
                seen[sig]["case"] = str(path)
                say(f"  wrote {path} ({small.describe()})")
            if not args.quiet:
                el = time.monotonic() - start
                print(
                    f"[{el / 60:5.1f} min] {ran} graphs, {totals['pass']} pass, "
                    f"{ran - totals['pass']} fail, {ran / el:.2f} graphs/s",
                    flush=True,
                )
    finally:
        if worker is not None:
            worker.close()
    elapsed = time.monotonic() - start
    summary = {
        "graphs": ran,
        "seconds": round(elapsed, 1),
        "first_seed": args.seed,
        "config": args.config,
        "dynamic": args.dynamic,
        "outcomes": dict(totals),
        "degraded": dict(degraded),
        "host_fallbacks": int(host),
        "max_error_over_scale": round(ratio_max, 3),
        "distinct_failures": list(seen.values()),
    }
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps({**summary, "failures": failures}, indent=2))
    return 0 if ran == totals["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
