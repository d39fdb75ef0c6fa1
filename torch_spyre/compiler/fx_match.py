"""Small matchers over post-grad FX graphs, shared by the spyre graph passes."""

from __future__ import annotations

import torch

#: ops that only re-view their input
VIEWS = ("reshape", "view", "_unsafe_view")


def on_spyre(node: torch.fx.Node, tuples: bool = False) -> bool:
    """Whether ``node``'s value is a spyre tensor (``tuples``: or a tuple whose
    first value is: a max pool's values and offsets)."""
    val = node.meta.get("val")
    if tuples and isinstance(val, list | tuple) and val:
        val = val[0]
    return isinstance(val, torch.Tensor) and val.device.type == "spyre"


def is_op(node, *names: str) -> bool:
    """Whether ``node`` calls an aten op (any overload) named one of ``names``."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and getattr(node.target, "__name__", "").split(".")[0] in names
    )


def through_views(node, seen: list):
    """The first producer of ``node`` that is not a view or a cast (those
    passed are appended to ``seen``)."""
    while is_op(node, *VIEWS, "convert_element_type"):
        seen.append(node)
        node = node.args[0]
    return node


def base(node):
    """``node`` with its views peeled off."""
    while is_op(node, *VIEWS):
        node = node.args[0]
    return node
