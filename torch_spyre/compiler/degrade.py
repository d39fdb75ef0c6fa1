"""The degrade path: planning never aborts a compile.

Inductor falls back to extern kernels for what it cannot lower; the spyre
backend degrades the same way, in this order, in this one place:

0. a graph sub-pass (a fusion, a route) whose rewrites Inductor's fake
   propagation rejects is **dropped** for that graph, the graph restored to
   what it was before it (``checked_passes.py``);
1. a fused group that cannot be planned as one kernel program is **split**:
   into halves (in the group's order, so every half's inputs are computed
   before it), each planned, down to single nodes;
2. a node that still cannot be planned runs **as eager device kernels**
   inside the compiled graph (``eager_nodes.py``: the FX nodes it came from,
   op by op through the eager library);
3. an op with no eager kernel then takes the eager layer's **counted host
   fallback**, as it would outside a compiled graph; a node with no FX node
   to re-run (a buffer Inductor realized inside another op's lowering) is
   computed **on the host** from its IR (``host_nodes.py``), counted as a
   host fallback too.  Only what none of these covers raises.

Every step is counted (``counts()``; per graph in ``GraphState.degraded``)
and reported: the compile log (logger ``torch_spyre.compiler``), a
``SpyreCompileWarning`` once per reason, the profiler and ``spyre
validate``.  The ``compile_fallback`` setting
(``TORCH_SPYRE_COMPILE_FALLBACK``) decides what a step does: ``warn`` (the
default) and ``allow`` degrade, ``error`` raises instead, so a model known to
plan can assert that it does.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from torch._inductor.virtualized import V

from torch_spyre import settings
from torch_spyre.ir import ProgramError
from torch_spyre.kernels.search import Unsupported
from torch_spyre.runtime.compiled import SpyreCompileWarning  # noqa: F401 (re-exported)

log = logging.getLogger("torch_spyre.compiler")

#: what a planner raises for a group it cannot plan: Unsupported and the
#: card's rejections; other exceptions are planner bugs, degraded likewise but
#: named as such (``error`` mode raises them)
PLAN_ERRORS = (Unsupported, ProgramError, NotImplementedError)


@dataclass
class EagerNode:
    """A scheduler node to run as eager device kernels, and why."""

    node: object
    reason: str


#: process-wide counts: "split" (groups split), "eager" (nodes run eagerly),
#: "eager_extern" (extern matmuls run as their eager kernel), "host" (nodes
#: computed on the host from their IR), "pass" (graph sub-passes dropped)
_counts: Counter[str] = Counter()


def counts() -> dict[str, int]:
    """Degrade steps taken by the compiles of this process."""
    return {k: _counts.get(k, 0) for k in ("split", "eager", "eager_extern", "host", "pass")}


def reset_counts() -> None:
    _counts.clear()


def _origins(node) -> str:
    """The ops a scheduler node came from (for messages)."""
    names = sorted(
        {
            str(o.target).split(".")[-2] if "." in str(o.target) else str(o.target)
            for n in node.get_nodes()
            for o in (getattr(n.node, "origins", None) or ())
            if o.op == "call_function"
        }
    )
    return ", ".join(names) or "?"


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if not isinstance(err, PLAN_ERRORS):
        text = f"planner error {type(err).__name__}: {text}"
    return text


def step(kind: str, what: str, reason: str, state=None) -> None:
    """One degrade step: counted and logged, or raised under
    ``compile_fallback=error`` (a split never is).  The graph's module notes it
    when it loads (``runtime.compiled.note_degraded``: the warning, once per
    reason), so a graph from Inductor's cache reports it as a fresh one does."""
    policy = settings.get().compile_fallback
    message = f"spyre compiler: {what}: {reason}"
    if policy == "error" and kind != "split":
        raise Unsupported(
            message + " (TORCH_SPYRE_COMPILE_FALLBACK=error: degrading is off; set it to "
            "'warn' to run this part as eager kernels, or file an issue with this message)"
        )
    _counts[kind] += 1
    log.info(message)
    if state is not None:
        state.degraded[kind] = state.degraded.get(kind, 0) + 1
        if kind != "split":
            state.degraded_nodes.append((what, reason))
    try:
        wrapper = V.graph.wrapper_code
    except AttributeError:  # outside a graph's codegen (a graph pass, unit tests)
        wrapper = None
    if wrapper is not None:
        note(wrapper, kind, what, reason)


def note(wrapper, kind: str, what: str, reason: str) -> None:
    """Write the step into the compiled graph's header: its module reports
    it when it loads (``runtime.compiled.note_degraded``)."""
    wrapper.header.writeline(f"spyre_rt.note_degraded([{(kind, what, reason)!r}])")


def plan_group(nodes: list, plan: Callable[[list], object], state=None) -> list:
    """Plans for ``nodes`` (a fused group, in order): one plan when the group
    plans, else the plans and ``EagerNode``s of its halves, recursively."""
    try:
        return [plan(nodes)]
    except Exception as err:  # noqa: BLE001 - every failure degrades (and is counted)
        if isinstance(err, Unsupported) and "TORCH_SPYRE_COMPILE_FALLBACK=error" in str(err):
            raise  # a refused step inside the group's planning (a nested extern)
        reason = _reason(err)
        if len(nodes) == 1:
            n = nodes[0]
            step(
                "eager", f"{n.get_name()} (from {_origins(n)}) runs as eager kernels", reason, state
            )
            return [EagerNode(n, reason)]
        step("split", f"a fused group of {len(nodes)} nodes is split", reason, state)
        mid = len(nodes) // 2
        return plan_group(nodes[:mid], plan, state) + plan_group(nodes[mid:], plan, state)


__all__ = [
    "PLAN_ERRORS",
    "EagerNode",
    "SpyreCompileWarning",
    "counts",
    "note",
    "plan_group",
    "reset_counts",
    "step",
]
