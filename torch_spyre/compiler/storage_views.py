"""Views and the storage under them, in the post-grad FX graph.

An in-place op on a view of a computed tensor (``v[1].index_add_`` of a
pointwise ``v``, made in place by ``passes._index_put_in_place``) is
decomposed by Inductor into an ``as_strided`` of the *storage* the view
shares, with absolute offsets; Inductor lowers that as a reinterpretation of
the buffer holding the view, which for a view of an unrealized computation
is the view's own buffer (1280 of the storage's 2560 elements): the read ran
past it (fuzzer seed 600951).  Such a write goes into a dense copy instead.
"""

from __future__ import annotations

import torch


def _view_root(n: torch.fx.Node) -> torch.fx.Node:
    """The tensor at the root of ``n``'s chain of view ops (same storage)."""
    while (
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.is_view
        and n.args
        and isinstance(n.args[0], torch.fx.Node)
    ):
        n = n.args[0]
    return n


def view_of_computed(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a view of a tensor the graph computes (not an input)."""
    root = _view_root(n)
    return root is not n and root.op == "call_function"
