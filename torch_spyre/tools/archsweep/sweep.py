"""The sweep: every model type in worker processes, results kept as they come.

A worker process runs types one after another and appends each row to the
results file (JSON lines) the moment it has it, so a sweep that stops (a
crash, a timeout, ^C) resumes where it stopped: types already in the file are
skipped.  The parent watches each type's time: a type that runs past
``timeout`` seconds, or kills its worker, gets a row saying so and the worker
is restarted on the types left.  ``jobs`` workers split the types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from torch_spyre.tools.archsweep.configs import ModelType, model_types
from torch_spyre.tools.archsweep.run import Row

#: a fixed sample for CI across families (dense, MoE, hybrid and state-space,
#: latent attention, encoders, older GPT-style decoders) from their ecosystem
#: default configs: the types tests/models/test_matrix.py does not compile
#: already from its own configs, plus one dense decoder, one MoE, one latent-
#: attention model and one encoder that it does (the sweep's path for them)
CI_SAMPLE: tuple[str, ...] = (
    # dense decoders
    "llama", "cohere", "bloom", "glm4", "helium",
    # mixtures of experts
    "mixtral", "olmoe", "granitemoeshared", "gpt_oss", "phimoe",
    # hybrids and state-space
    "lfm2", "falcon_mamba", "qwen3_next",
    # latent attention
    "deepseek_v3", "minicpm3",
    # encoders
    "bert", "distilbert", "modernbert", "deberta-v2",
)  # fmt: skip


def selected(names: list[str] | None = None, sample: str | None = None) -> list[ModelType]:
    """The types to run: named ones, the CI sample, or all."""
    every = model_types()
    if sample == "ci":
        names = list(CI_SAMPLE)
    if not names:
        return every
    by_name = {m.name: m for m in every}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"archsweep: unknown model types {unknown}; see --list")
    return [by_name[n] for n in names]


def load(path: Path) -> dict[str, Row]:
    """Rows already in a results file (the last row of a type wins).

    Only whole lines count: a worker may be writing the last line while the
    parent reads, and a worker killed mid-write leaves a line that does not
    parse; such a type has no row yet, so it runs (again)."""
    rows: dict[str, Row] = {}
    if not path.exists():
        return rows
    lines = path.read_bytes().split(b"\n")[:-1]  # the last piece has no newline yet
    for line in lines:
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[d["type"]] = Row.from_dict(d)
    return rows


def _append(path: Path, row: Row) -> None:
    """One row as one write; a line left unfinished by a killed worker is
    ended first, so the row starts on a line of its own."""
    data = (json.dumps(row.to_dict()) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(
    types: list[ModelType], out: Path, progress: Path, compile: bool, wide: bool = False
) -> None:
    """Run ``types`` in this process, one row each appended to ``out``."""
    from torch_spyre.tools.archsweep.run import run_type

    for mt in types:
        progress.write_text(f"{mt.name} {time.time()}\n")
        _append(out, run_type(mt, compile=compile, wide=wide))
    progress.write_text("")


#: the worker's command line (its arguments follow)
WORKER: list[str] = [sys.executable, "-m", "torch_spyre.tools.archsweep", "--worker"]


def _spawn(
    names: list[str], out: Path, progress: Path, compile: bool, wide: bool
) -> subprocess.Popen:
    cmd = [*WORKER, "--out", str(out), "--progress", str(progress)]
    cmd += ["--types", ",".join(names)]
    if not compile:
        cmd.append("--eager-only")
    if wide:
        cmd.append("--wide")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def sweep(
    types: list[ModelType],
    out: Path,
    *,
    jobs: int = 1,
    timeout: float = 600.0,
    compile: bool = True,
    wide: bool = False,
    echo=print,
) -> dict[str, Row]:
    """Run every type not yet in ``out``; returns all rows of ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = load(out)
    todo = [m for m in types if m.name not in done]
    echo(f"archsweep: {len(types)} types, {len(types) - len(todo)} already in {out}")
    family = {m.name: m.family for m in types}
    queues = [todo[i::jobs] for i in range(jobs)]
    workers: list[dict] = []
    for i, q in enumerate(queues):
        if q:
            prog = out.with_suffix(f".progress{i}")
            workers.append({"left": [m.name for m in q], "prog": prog, "proc": None})
    reported = set(done)
    while workers:
        time.sleep(0.5)
        rows = load(out)
        for name in sorted(set(rows) - reported):
            reported.add(name)
            echo(_line(rows[name]))
        for w in list(workers):
            w["left"] = [n for n in w["left"] if n not in rows]
            if not w["left"]:
                workers.remove(w)
                continue
            proc = w["proc"]
            if proc is None:
                w["prog"].write_text("")
                w["proc"] = _spawn(w["left"], out, w["prog"], compile, wide)
                continue
            current, started = _current(w["prog"])
            over = current is not None and time.time() - started > timeout
            if proc.poll() is None and not over:
                continue
            if over:
                proc.kill()
                proc.wait()
            if current is not None and current not in load(out):
                err = "" if over else (proc.stderr.read() or b"").decode()[-300:]
                row = Row(current, family.get(current, ""), status="timeout" if over else "crash")
                row.error = f"over {timeout:.0f} s" if over else " ".join(err.split())
                _append(out, row)
            w["proc"] = None
    return load(out)


def _current(progress: Path) -> tuple[str | None, float]:
    try:
        text = progress.read_text().split()
    except FileNotFoundError:
        return None, 0.0
    return (text[0], float(text[1])) if len(text) == 2 else (None, 0.0)


def _line(r: Row) -> str:
    if r.status != "ok":
        return f"  {r.type:<26} {r.status}: {r.error[:100]}"
    e, c = r.eager, r.compiled
    return (
        f"  {r.type:<26} {r.mode:<7} eager {e.verdict:<8} compiled {c.verdict:<8} "
        f"diff {c.max_diff:.1e} degraded {sum(c.degraded.values())} "
        f"host {e.host_fallbacks}/{c.host_fallbacks} {r.wall_s:5.1f}s "
        f"{(c.error or e.error)[:80]}"
    )
