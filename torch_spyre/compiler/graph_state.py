"""What the spyre backend keeps while it compiles one graph.

Inductor makes one wrapper codegen object per graph (ours is
``SpyreWrapperCodegen``); the backend's per-graph state is a ``GraphState``
on it, with typed fields, written by the scheduling (``scheduling.py``) as
it emits kernels and read by the layout choice (``layouts.py``) and the
matmul prologues (``matmuls.py``).  ``current()`` is the state of the graph
being compiled (a fresh one for a wrapper that is not ours, e.g. Inductor's
subgraph wrapper).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch_spyre.layout import SpyreTensorLayout


@dataclass
class GraphState:
    #: extern matmuls emitted and still open to absorbing their epilogue, by
    #: output buffer (``scheduling._PendingMatmul``)
    pending: dict[str, Any] = field(default_factory=dict)
    #: restickified copies launched so far: (buffer, layout) -> the wrapper
    #: variable holding the copy (``layouts.copies``)
    relaid: dict[tuple[str, SpyreTensorLayout], str] = field(default_factory=dict)
    #: reads of each buffer by kernels emitted so far (``layouts._readers``)
    reads: dict[str, int] = field(default_factory=dict)
    #: buffers stored whole in a non-default layout (``layouts.layout_of``)
    layouts: dict[str, SpyreTensorLayout] = field(default_factory=dict)
    #: weight prologues (dequantisation) fused into their matmul, by weight
    #: buffer (``matmuls.Prologue``)
    prologues: dict[str, Any] = field(default_factory=dict)
    #: kernel names defined in the wrapper module's header
    defined: set[str] = field(default_factory=set)
    #: degrade steps taken in this graph by kind (``degrade.py``: split, eager,
    #: eager_extern) and the nodes run as eager kernels, with the reason
    degraded: dict[str, int] = field(default_factory=dict)
    degraded_nodes: list[tuple[str, str]] = field(default_factory=list)


#: state of wrappers that are not ours (no field to hold it)
_OTHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of(wrapper) -> GraphState:
    """The state kept for ``wrapper`` (one graph's wrapper codegen)."""
    state = getattr(wrapper, "spyre", None)
    if isinstance(state, GraphState):
        return state
    state = _OTHERS.get(wrapper)
    if state is None:
        state = _OTHERS[wrapper] = GraphState()
    return state


def current() -> GraphState | None:
    """The state of the graph being compiled; None outside Inductor's codegen."""
    try:
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
    except Exception:
        return None
    return of(wrapper)
