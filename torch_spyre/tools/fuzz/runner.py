"""Running a graph three ways and classifying the outcome.

``check(graph)`` runs the graph on the CPU (the reference, ``oracle.py``),
eagerly on spyre and under ``torch.compile`` on spyre (``fullgraph=True,
dynamic=False``; ``dynamic=True``: every size symbolic, as automatic dynamic
shapes makes them on a recompile, which the compiler specialises), compares
every output, and returns an ``Outcome``:

* ``pass``: both spyre runs match the reference;
* ``mismatch``: the compiled graph gives a wrong answer (a compiler bug);
* ``eager_mismatch``: the eager kernels give a wrong answer (an op bug);
* ``compile_error``: ``torch.compile`` raised while compiling;
* ``eager_error``: an eager spyre op raised;
* ``crash``: the compiled graph raised when it ran (or the process died:
  the long mode runs graphs in a child process);
* ``invalid``: the CPU refused the graph (a bug of the fuzzer's grammar).

Degrade steps (``compiler.degrade.counts()``: groups split, nodes run as
eager kernels, extern matmuls run as the eager kernel) and host fallbacks
during the compiled run (``runtime.dispatch_stats``) are recorded per run.

``check_many(graphs)`` merges graphs into one (``generator.merge``) so that
many small graphs share one compile, and splits the verdict back: a merged
run that raises is bisected to the graphs that raise alone.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

import torch_spyre
from torch_spyre.compiler import degrade
from torch_spyre.runtime import dispatch_stats
from torch_spyre.tools.fuzz.generator import merge
from torch_spyre.tools.fuzz.graph import Graph
from torch_spyre.tools.fuzz.oracle import build, compare, reference

PASS = "pass"
MISMATCH = "mismatch"
EAGER_MISMATCH = "eager_mismatch"
COMPILE_ERROR = "compile_error"
EAGER_ERROR = "eager_error"
CRASH = "crash"
INVALID = "invalid"
FAILURES = (MISMATCH, EAGER_MISMATCH, COMPILE_ERROR, EAGER_ERROR, CRASH, INVALID)


@dataclass
class Outcome:
    status: str
    detail: str = ""
    #: largest error / error scale over the outputs that passed (calibration)
    ratio: float = 0.0
    ill_conditioned: int = 0
    degraded: dict[str, int] = field(default_factory=dict)
    host_fallbacks: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in FAILURES


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:600]


def _is_compile_error(err: BaseException) -> bool:
    from torch._dynamo.exc import BackendCompilerFailed

    names = {type(e).__name__ for e in _chain(err)}
    return isinstance(err, BackendCompilerFailed) or bool(
        names
        & {
            "InductorError",
            "BackendCompilerFailed",
            "Unsupported",
            "TorchRuntimeError",
            "UserError",
        }
    )


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def run_compiled(
    graph: Graph, inputs: list[torch.Tensor], dynamic: bool = False
) -> list[torch.Tensor]:
    fn, _, _ = build(graph)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        return list(compiled(*inputs))


def check(
    graph: Graph, compiled: bool = True, eager: bool = True, dynamic: bool = False
) -> Outcome:
    """Run ``graph`` on the CPU, eagerly on spyre and compiled on spyre
    (``dynamic``: with symbolic sizes)."""
    # each graph starts on a working card: a kernel that failed on it for the
    # previous graph left it in its stream error until reset
    torch.spyre.reset_device_state()
    t0 = time.perf_counter()
    out = Outcome(PASS)
    fn, make_inputs, _ = build(graph)
    try:
        ref = reference(graph, make_inputs("cpu"))
    except Exception as err:  # noqa: BLE001 - a grammar bug, reported as such
        return Outcome(INVALID, _short(err) + "\n" + traceback.format_exc(limit=-3))
    out.ill_conditioned = sum(ref.ill)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if eager:
            try:
                with torch.no_grad():
                    got = list(fn(*make_inputs("spyre")))
            except Exception as err:  # noqa: BLE001
                out.status, out.detail = EAGER_ERROR, _short(err)
                got = None
            if got is not None:
                for k, g in enumerate(got):
                    ok, msg, ratio = compare(g, ref, k)
                    if not ok:
                        out.status, out.detail = EAGER_MISMATCH, msg
                        break
        if compiled:
            before = Counter(degrade.counts())
            fb_before = sum(dispatch_stats.counts("fallback").values())
            try:
                got = run_compiled(graph, make_inputs("spyre"), dynamic=dynamic)
            except Exception as err:  # noqa: BLE001
                status = COMPILE_ERROR if _is_compile_error(err) else CRASH
                out.status, out.detail = status, _short(err)
                got = None
            out.degraded = dict(Counter(degrade.counts()) - before)
            out.host_fallbacks = sum(dispatch_stats.counts("fallback").values()) - fb_before
            if got is not None:
                for k, g in enumerate(got):
                    ok, msg, ratio = compare(g, ref, k)
                    if not ok:
                        out.status, out.detail = MISMATCH, msg
                        break
                    if math.isfinite(ratio):
                        out.ratio = max(out.ratio, ratio)
    out.seconds = time.perf_counter() - t0
    return out


def _outputs_of(graph: Graph, keep: list[int]) -> Graph:
    g = graph.copy()
    g.outputs = [graph.outputs[k] for k in keep]
    return g


def check_many(
    graphs: list[Graph], seed: int = 0, dynamic: bool = False
) -> tuple[list[Outcome], Outcome]:
    """One merged run of ``graphs``; each graph's outcome, and the merged one.

    A merged run that fails is bisected down to the graphs that fail alone;
    if none fails alone, the merged failure is reported against every graph
    of the half that failed (the bug needs them together)."""
    merged, spans = merge(graphs, seed=seed)
    whole = check(merged, dynamic=dynamic)
    if not whole.failed:
        return [Outcome(PASS, ratio=whole.ratio) for _ in graphs], whole
    if len(graphs) == 1:
        return [whole], whole
    mid = len(graphs) // 2
    left, _ = check_many(graphs[:mid], seed, dynamic)
    right, _ = check_many(graphs[mid:], seed + 1, dynamic)
    results = left + right
    if not any(r.failed for r in results):
        results = [Outcome(whole.status, "only when merged: " + whole.detail) for _ in graphs]
    return results, whole


def quiet() -> None:
    """Settings for a fuzzing process: host fallbacks and degrade warnings
    are counted, not printed."""
    torch_spyre.set_fallback_policy("silent")
    warnings.filterwarnings("ignore", category=degrade.SpyreCompileWarning)


__all__ = [
    "COMPILE_ERROR",
    "CRASH",
    "EAGER_ERROR",
    "EAGER_MISMATCH",
    "FAILURES",
    "INVALID",
    "MISMATCH",
    "PASS",
    "Outcome",
    "check",
    "check_many",
    "quiet",
    "run_compiled",
]
