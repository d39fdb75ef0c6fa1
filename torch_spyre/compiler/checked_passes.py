"""Graph passes whose every rewrite Inductor can carry: a rewrite that fake
propagation rejects is dropped, never raised out of the compile.

The spyre graph pass (``passes.SpyreGraphPass``) rewrites the post-grad graph
in a sequence of sub-passes (fusions, routes, lane rewrites).  A rewrite
whose product Inductor cannot propagate — an op whose output strides changed
under a reader that views them (the ``--wide`` architecture sweep found three:
Helium's interleaved rotary, GLM-MoE-DSA's and DeepSeek-V3.2's indexers) —
would otherwise raise in Inductor's next fake-tensor update, and the user
would be left with no compiled model at all.  Here:

1. the sub-passes run as one unit and the nodes they changed (and their
   readers, until the values stop changing) are propagated again with fake
   tensors, as Inductor's own post-grad passes do next
   (``torch._inductor.fx_utils.FakeTensorUpdater``);
2. if that raises, the graph is restored from a copy taken before, and the
   sub-passes run again one at a time, each checked the same way; a sub-pass
   whose rewrites fail is undone and dropped for this graph: a degrade step
   of kind ``pass`` (``degrade.py``: counted, logged, a warning once per
   reason when the compiled graph loads, refused under
   ``TORCH_SPYRE_COMPILE_FALLBACK=error``).

The check costs one incremental propagation of the changed nodes; the
one-at-a-time rerun only happens on a graph that failed it.

Why an Inductor internal: no public hook checks a custom pass's product
before Inductor consumes it, and ``FakeTensorUpdater`` is exactly the update
that raised (``torch/_inductor/fx_passes/post_grad.py`` runs it after the
custom passes).  ``tests/compiler/test_checked_passes.py`` fails if its
constructor or ``incremental_update`` change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._inductor.fx_utils import FakeTensorUpdater
from torch._inductor.virtualized import NullHandler, V

from torch_spyre.compiler import degrade

#: a sub-pass: (name for messages, function rewriting the graph module in
#: place and returning whether it changed anything)
SubPass = tuple[str, Callable[[torch.fx.GraphModule], bool]]

#: the graph module meta key holding the sub-passes dropped from this graph
#: (what, reason), written into the compiled graph's header
#: (``scheduling.SpyreWrapperCodegen.write_header``)
DROPPED = "spyre_dropped_passes"


def run(gm: torch.fx.GraphModule, passes: Sequence[SubPass]) -> bool:
    """Apply ``passes`` in order to ``gm``, dropping any whose rewrites fake
    propagation rejects (see the module docstring).  Returns whether the
    graph changed."""
    snapshot = _Snapshot(gm.graph)
    checker = FakeTensorUpdater(gm)
    changed = False
    for _, fn in passes:
        changed = fn(gm) or changed
    if not changed:
        return False
    error = _propagate(checker)
    if error is None:
        return True
    # one at a time: keep every sub-pass that propagates, drop the others
    snapshot.restore(gm.graph)
    changed = False
    for name, fn in passes:
        before = _Snapshot(gm.graph)
        checker = FakeTensorUpdater(gm)
        if not fn(gm):
            continue
        error = _propagate(checker)
        if error is None:
            changed = True
            continue
        before.restore(gm.graph)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        what = f"graph pass {name!r} is dropped for this graph (its rewrite does not propagate)"
        gm.meta.setdefault(DROPPED, []).append((what, reason))
        degrade.step("pass", what, reason)
    return changed


def _propagate(checker: FakeTensorUpdater) -> Exception | None:
    """The error fake propagation of the changed nodes raises, or None."""
    try:
        with _fake_mode(checker.gm):
            checker.incremental_update()
    except Exception as e:  # noqa: BLE001 - any failure here would fail the compile later
        return e
    return None


def _fake_mode(gm: torch.fx.GraphModule):
    """Inside Inductor the fake mode is set (``V.fake_mode``); outside it (a
    graph traced by hand) it is the one of the graph's placeholder values."""
    if not isinstance(V.fake_mode, NullHandler):
        return contextlib.nullcontext()
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    return V.set_fake_mode(mode) if mode is not None else contextlib.nullcontext()


class _Snapshot:
    """A copy of a graph's nodes after its placeholders, restorable in place
    (the graph object, its placeholders and the graph module stay the ones
    Inductor holds)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = torch.fx.Graph()
        self.to_copy: dict[torch.fx.Node, torch.fx.Node] = {}
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        rv = self.graph.graph_copy(graph, self.to_copy, return_output_node=True)
        if rv is not None:
            value, out = rv
            self.graph.output(value).meta = dict(out.meta)

    def restore(self, graph: torch.fx.Graph) -> None:
        for node in reversed(list(graph.nodes)):
            if node.op != "placeholder":
                graph.erase_node(node)
        # the copy's placeholders stand for the live ones
        val_map = {self.to_copy[p]: p for p in self.placeholders}
        extra = [n for n in self.graph.nodes if n.op == "placeholder" and n not in val_map]
        if extra:  # a sub-pass never adds graph inputs
            raise RuntimeError("checked_passes: the snapshot has placeholders the graph lacks")
        rv = graph.graph_copy(self.graph, val_map, return_output_node=True)
        if rv is not None:
            value, out = rv
            graph.output(value).meta = dict(out.meta)
