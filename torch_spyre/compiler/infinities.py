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


def may_be_infinite(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> bool:
    """Whether ``node``'s value may hold an infinity the graph itself writes:
    an ancestor fills with ``-inf`` (an attention mask built with
    ``full(-inf)`` / ``masked_fill``), holds a constant with one, or is a log.
    (DeepSeek-V4's compressed-KV mask came out NaN through a lane placement:
    a silent wrong answer in the architecture sweep.)  Infinities in the
    graph's inputs or from overflow are not looked for."""
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and gm is not None:
            value = getattr(gm, str(n.target), None)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                if not bool(torch.isfinite(value.cpu()).all()):
                    return True
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        name = schema.name if schema is not None else ""
        if name in _MASKED_ATTENTION:
            todo.extend(
                a for a in n.args[: _MASKED_ATTENTION[name]] if isinstance(a, torch.fx.Node)
            )
            continue
        if _literal_non_finite(list(n.args)) or _literal_non_finite(list(n.kwargs.values())):
            return True
        if name in _MAKES_INF:
            return True
        todo.extend(n.all_input_nodes)
    return False
