"""Whether a graph value may hold an infinity the graph itself writes.

A lane placement or lane gather on the PE array multiplies every value by a
0/1 table, and ``inf * 0`` is NaN: a value that may be infinite is moved
another way (the device's cat, a select on the vector unit) or left to the
eager kernels.  The walk goes up a node's ancestors; it stops at ops whose
output is finite whatever masks went in (attention: a softmax-weighted sum
of the values), so a layer after the first is not tainted by the first
layer's ``-inf`` mask.
"""

from __future__ import annotations

import math
import weakref

import torch

#: ops that turn finite values into infinities by design (``log(mask)``)
_MAKES_INF = ("aten::log", "aten::log2", "aten::log10", "aten::reciprocal")

#: ops whose output is finite when their value inputs are, whatever their mask
#: holds (``-inf`` added to the scores only weights the softmax): the walk
#: follows their value inputs (q, k, v) and not the mask
_MASKED_ATTENTION = {
    "spyre::attention": 3,
    "spyre::attention_bshd": 3,
    "spyre::attention_ext": 3,
    "aten::scaled_dot_product_attention": 3,
    "aten::_scaled_dot_product_flash_attention_for_cpu": 3,
}


def _literal_non_finite(a) -> bool:
    if isinstance(a, float):
        return not math.isfinite(a)
    if isinstance(a, list | tuple):
        return any(_literal_non_finite(x) for x in a)
    return False


def _own(n: torch.fx.Node, gm: torch.fx.GraphModule | None) -> tuple[bool, list[torch.fx.Node]]:
    """Whether ``n`` itself writes an infinity, and the inputs the walk follows."""
    if n.op == "get_attr" and gm is not None:
        value = getattr(gm, str(n.target), None)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(value.cpu()).all()):
                return True, []
    if n.op != "call_function":
        return False, []
    schema = getattr(n.target, "_schema", None)
    name = schema.name if schema is not None else ""
    if name in _MASKED_ATTENTION:
        return False, [a for a in n.args[: _MASKED_ATTENTION[name]] if isinstance(a, torch.fx.Node)]
    if _literal_non_finite(list(n.args)) or _literal_non_finite(list(n.kwargs.values())):
        return True, []
    if name in _MAKES_INF:
        return True, []
    return False, list(n.all_input_nodes)


def may_be_infinite(
    node: torch.fx.Node,
    gm: torch.fx.GraphModule | None = None,
    memo: dict[torch.fx.Node, bool] | None = None,
) -> bool:
    """Whether ``node``'s value may hold an infinity the graph itself writes:
    an ancestor fills with ``-inf`` (an attention mask built with
    ``full(-inf)`` / ``masked_fill``), holds a constant with one, or is a log.
    (DeepSeek-V4's compressed-KV mask came out NaN through a lane placement:
    a silent wrong answer in the architecture sweep.)  Infinities in the
    graph's inputs or from overflow are not looked for.

    ``memo``: each node's answer, kept by the caller across calls on one
    graph (a pass's rewrites keep every value, so answers stay true)."""
    memo = {} if memo is None else memo
    stack = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in memo:
            continue
        own, inputs = _own(n, gm)
        if own:
            memo[n] = True
        elif expanded:
            memo[n] = any(memo[p] for p in inputs)
        else:
            stack.append((n, True))
            stack.extend((p, False) for p in inputs if p not in memo)
    return memo[node]


#: per graph being lowered, each node's answer (``any_may_be_infinite``)
_LOWERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def any_may_be_infinite(nodes) -> bool:
    """``may_be_infinite`` of any of ``nodes`` (of a graph Inductor lowers,
    which no longer changes), each node's answer kept per graph: the
    planner asks for the origins of every kernel it lowers, and a walk each
    went up the whole graph (16 layers: 20 s of a 120 s compile)."""
    return any(may_be_infinite(n, None, _LOWERED.setdefault(n.graph, {})) for n in nodes)
