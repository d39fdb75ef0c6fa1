"""Running the selected ops: in this process, or in worker processes that may die."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

import torch_spyre
from torch_spyre.tools.opcheck.compare import run_op
from torch_spyre.tools.opcheck.results import OpResult
from torch_spyre.tools.opcheck.selection import DEFAULT_DTYPES


def _prepare_process(threads: int | None) -> None:
    torch_spyre.set_fallback_policy("silent")
    if threads is not None:
        torch.set_num_threads(threads)


def run_in_process(
    ops: Sequence[Any],
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_samples: int | None = None,
    progress: Callable[[OpResult, int, int], None] | None = None,
) -> list[OpResult]:
    """Run ``ops`` here, one after another (no protection against a crash)."""
    old = torch_spyre.get_fallback_policy()
    _prepare_process(None)
    results = []
    try:
        for i, op in enumerate(ops):
            results.append(run_op(op, dtypes, max_samples))
            if progress is not None:
                progress(results[-1], i + 1, len(ops))
    finally:
        torch_spyre.set_fallback_policy(old)
    return results


def _worker_main(
    conn: Connection, ops: Sequence[Any], dtypes: Sequence[torch.dtype], max_samples: int | None
) -> None:
    # one intra-op thread per worker: the workers already fill the cores
    _prepare_process(1)
    while True:
        index = conn.recv()
        if index is None:
            return
        result = run_op(
            ops[index], dtypes, max_samples, on_sample=lambda w: conn.send(("sample", w))
        )
        # a plain dict: under `python -m` the class lives in __main__, which
        # the parent cannot unpickle by name
        conn.send(("done", asdict(result)))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    index: int | None = None
    started: float = 0.0
    sample: str = ""


def _death(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_in_workers(
    ops: Sequence[Any],
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_samples: int | None = None,
    jobs: int = 2,
    timeout_s: float = 300.0,
    progress: Callable[[OpResult, int, int], None] | None = None,
) -> list[OpResult]:
    """Run ``ops`` in ``jobs`` forked worker processes, one op at a time each.

    Worker k runs ops k, k+jobs, k+2*jobs, ... in that order, whatever the
    timing: an op's result may depend on what ran before it in the same
    process (kernel caches, allocator state), and a fixed order keeps the
    report reproducible and such bugs reproducible with ``--jobs 1``.
    A worker that dies or runs one op longer than ``timeout_s`` is replaced
    and its op is reported as ``crash`` with the sample it was running.
    Forking (not spawning) keeps whatever this process loaded, the OpInfo
    database included, and works for ops defined at run time (tests).
    """
    ctx = multiprocessing.get_context("fork")
    jobs = max(1, min(jobs, len(ops)))
    results: dict[int, OpResult] = {}
    queues = [list(range(k, len(ops), jobs))[::-1] for k in range(jobs)]
    workers: dict[int, _Worker] = {}  # slot -> its live worker

    def spawn() -> _Worker:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, ops, dtypes, max_samples), daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def finish(index: int, result: OpResult) -> None:
        results[index] = result
        if progress is not None:
            progress(result, len(results), len(ops))

    def stop(slot: int) -> None:
        w = workers.pop(slot)
        w.conn.close()
        w.process.join(5)

    def crashed(slot: int, why: str) -> None:
        w = workers[slot]
        op = ops[w.index]
        res = OpResult(op.name, op.variant_test_name, crashed=f"worker {why}")
        res.first_error, res.first_error_at = res.crashed, w.sample
        res.seconds = time.monotonic() - w.started
        finish(w.index, res)
        stop(slot)

    try:
        while len(results) < len(ops):
            for slot, queue in enumerate(queues):
                w = workers.get(slot)
                if w is not None and w.index is None and not queue:
                    w.conn.send(None)  # nothing left for this slot
                    stop(slot)
                    continue
                if queue and (w is None or w.index is None):
                    if w is None:
                        w = workers[slot] = spawn()
                    w.index, w.started, w.sample = queue.pop(), time.monotonic(), ""
                    w.conn.send(w.index)
            ready = wait([w.conn for w in workers.values()], timeout=1.0)
            for slot, w in list(workers.items()):
                if w.conn in ready:
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError):
                        w.process.join(5)
                        crashed(slot, _death(w.process))
                        continue
                    if kind == "sample":
                        w.sample = payload
                    else:
                        finish(w.index, OpResult(**payload))
                        w.index = None
                elif time.monotonic() - w.started > timeout_s:
                    w.process.kill()
                    w.process.join(5)
                    crashed(slot, f"timed out after {timeout_s:.0f} s")
    finally:
        for w in workers.values():
            w.process.kill()
            w.process.join(5)
    return [results[i] for i in range(len(ops))]
