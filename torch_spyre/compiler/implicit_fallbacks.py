"""Custom ops' Inductor fallbacks, made before lowering, so that every graph lowers alike.

Inductor makes the fallback of an op that has no lowering (a ``torch.library``
custom op: ``spyre::attention_bshd``, vLLM's ops) the first time it lowers
one (``GraphLowering.call_function``), and ``make_fallback`` adds the op to
``lowering.needs_realized_inputs``.  From then on, an input of that op with
several users is realized as soon as it is lowered (``GraphLowering.run_node``),
before its other users are.  So the first graph a process lowered, and within
a graph the first use of each such op, lowered differently from every later
one: Granite-3.3-8B's rotated K was recomputed inside its attention-layout
program in a fresh process, but stored and then copied after any earlier
compile (prefill 1.398x against 1.411x of the compute floor), and the FX-graph
cache kept whichever came first, so a modelled figure depended on what the
process, or an earlier process, had compiled before.

No public hook says how Inductor treats an op without a lowering, so the
spyre graph pass calls ``prepare`` before lowering: each custom op in the
graph gets its fallback as ``GraphLowering`` would make it (the layout
constraint of its tags), and custom ops stay out of
``needs_realized_inputs``, so every graph lowers as the first one did.
Built-in ATen ops are left to Inductor (their fallbacks are made at import,
or for a backward graph with another constraint).
``tests/compiler/test_implicit_fallbacks.py`` fails if Inductor changes any
of this.
"""

from __future__ import annotations

import torch


def _custom_ops(gm: torch.fx.GraphModule) -> set[torch._ops.OpOverload]:
    """The custom ops ``gm`` calls, directly or under ``auto_functionalized``
    (which Inductor's reinplacing turns back into a direct call after this
    pass: a KV-cache write's ``spyre::index_put_``)."""
    from torch._library.utils import is_builtin

    ops = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        op = n.target
        if isinstance(op, torch._ops.HigherOrderOperator) and n.args:
            op = n.args[0]
        if isinstance(op, torch._ops.OpOverload) and not is_builtin(op):
            ops.add(op)
    return ops


def prepare(gm: torch.fx.GraphModule) -> None:
    """Make the fallback of every custom op in ``gm`` that has no lowering yet,
    and keep custom ops out of Inductor's ``needs_realized_inputs``."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for op in _custom_ops(gm):
        if op not in lowering.lowerings:
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(
                op, layout_constraint=lowering.tag_to_layout_constraint(tag), warn=False
            )
        lowering.needs_realized_inputs.discard(op)


__all__ = ["prepare"]
