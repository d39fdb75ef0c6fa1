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
constraint of its tags, or ours: ``_any_layout_for_the_written_tensor``), and
custom ops stay out of ``needs_realized_inputs``, so every graph lowers as the
first one did.
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


def _any_layout_for_the_written_tensor(op: torch._ops.OpOverload):
    """``spyre::index_put_``'s layout constraint: Inductor's default for a
    custom op (every input in the stride order of its FX value), except the
    tensors the op writes in place (its schema's written arguments), which keep
    the layout Inductor gave them.

    The op's eager kernel writes any strided tensor.  Constrained, a written
    buffer whose strides differ from its FX value's only on a size-1 dim (a
    dense copy of a strided slice: [17, 1, 17] against [17, 1, 1]) was copied
    to the FX strides, and Inductor's write-back of that copy into the
    original (``GraphLowering.propagate_mutation``) made a buffer that loads
    from itself: the compile aborted (fuzzer routing seed 246).  The other
    inputs stay constrained: with no constraint at all (the
    ``flexible_layout`` tag) the cache writes of Granite's prefill lowered
    into other programs (236.9 -> 239.1 ms)."""
    import types

    from torch._inductor.lowering import constrain_to_fx_strides

    args = op._schema.arguments
    written = {i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write}
    names = {args[i].name for i in written}

    def constraint(fx_node, *a, **kw):
        # the written inputs look like non-tensors to Inductor's constraint
        unwritten = types.SimpleNamespace(
            args=tuple(None if i in written else v for i, v in enumerate(fx_node.args)),
            kwargs={k: None if k in names else v for k, v in fx_node.kwargs.items()},
        )
        return constrain_to_fx_strides(unwritten, *a, **kw)

    return constraint


def _kv_rows_in_place(_fx_node, *args, **kwargs):
    """The attention ops' layout constraint: every input contiguous (what
    their ``needs_contiguous_strides`` tag asked), except K and V when they
    are the first rows of each head of a longer [b, h, S, d] buffer
    (``x[:, :, :n]``: transformers slices a static cache so for a causal
    prefill, ``sdpa_attention_forward``), which the flash program reads
    where they lie (``ops/attention._row_prefix``).
    Made contiguous, each was a copy of the prefix (2 x 37.4 us a layer of
    Granite-8B's 1,024-token prefill) and the cache rows' writes had a
    second reader, so they stayed kernels of their own."""
    from torch._inductor import ir
    from torch._inductor.lowering import require_contiguous_strides

    kv = {1: args[1], 2: args[2]} if len(args) > 2 else {}
    kept = {i: x for i, x in kv.items() if _rows_of_longer(x)}
    rest = tuple(None if i in kept else a for i, a in enumerate(args))
    rest, kwargs = require_contiguous_strides(_fx_node, *rest, **kwargs)
    out = list(rest)
    for i, x in kept.items():
        out[i] = ir.ExternKernel.require_exact_strides(x, x.get_layout().stride)
    return tuple(out), kwargs


def _rows_of_longer(x) -> bool:
    """Whether IR node ``x`` [b, h, n, d] is laid out as the first ``n`` rows
    of each head of a contiguous [b, h, S, d], S > n (strides fixed)."""
    from torch._inductor import ir

    try:
        layout = x.get_layout()
    except (AttributeError, NotImplementedError):
        return False
    if not isinstance(layout, ir.FixedLayout):
        return False
    try:
        size = [int(v) for v in layout.size]
        stride = [int(v) for v in layout.stride]
        offset = int(layout.offset)
    except TypeError:  # symbolic
        return False
    if len(size) != 4 or offset != 0 or stride[3] != 1 or stride[2] != size[3]:
        return False
    rows, extra = divmod(stride[1], size[3])
    return extra == 0 and rows > size[2] and stride[0] == size[1] * stride[1]


def _constraint(op: torch._ops.OpOverload):
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    if op is torch.ops.spyre.index_put_.default:
        return _any_layout_for_the_written_tensor(op)
    spyre = torch.ops.spyre
    # the ops whose K and V may be a static cache's row prefix
    if op in (spyre.attention.default, spyre.attention_bshd.default, spyre.attention_ext.default):
        return _kv_rows_in_place
    return lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))


def prepare(gm: torch.fx.GraphModule) -> None:
    """Make the fallback of every custom op in ``gm`` that has no lowering yet,
    and keep custom ops out of Inductor's ``needs_realized_inputs``."""
    from torch._inductor import lowering

    for op in _custom_ops(gm):
        if op not in lowering.lowerings:
            lowering.make_fallback(op, layout_constraint=_constraint(op), warn=False)
        lowering.needs_realized_inputs.discard(op)


__all__ = ["prepare"]
