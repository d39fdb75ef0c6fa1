"""Shrinking a failing graph, and writing it as a regression test.

``minimise(graph, fails)`` is delta debugging over the graph's structure: it
keeps a change whenever the smaller graph still type-checks and still fails
the same way (``same_failure``), and repeats until nothing changes:

1. keep one output (the failing one first);
2. cut a computed node: it becomes a fresh input of its shape, dtype and
   value range, and everything only it needed is dropped;
3. bypass a node: its readers read its operand instead (same shape and
   dtype);
4. shrink sizes: each size an input's shape spells out is tried at 1, at
   half and one less (every shape tied to it follows; the inference rejects
   a graph that no longer fits);
5. make non-contiguous inputs contiguous.

``write_case`` writes the result as a pytest file: the graph's code, its
inputs and the tolerances the oracle measured, frozen.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from torch_spyre.tools.fuzz.graph import Graph, Invalid, Node
from torch_spyre.tools.fuzz.oracle import build, reference
from torch_spyre.tools.fuzz.runner import Outcome


def ancestors(g: Graph, roots: list[int]) -> set[int]:
    keep: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        n = g.nodes[i]
        stack.extend(n.args)
        if n.op == "input":
            stack.extend(e[0] for e in n.attrs["shape"] if not isinstance(e, int))
            high = n.attrs.get("high")
            if high is not None and not isinstance(high, int):
                stack.append(high[0])
    return keep


def prune(g: Graph) -> Graph:
    """``g`` without the nodes its outputs do not need (renumbered)."""
    keep = sorted(ancestors(g, g.outputs))
    new_index = {old: new for new, old in enumerate(keep)}
    out = Graph(seed=g.seed)
    for old in keep:
        n = g.nodes[old]
        attrs = dict(n.attrs)
        if n.op == "input":
            attrs["shape"] = [
                e if isinstance(e, int) else [new_index[e[0]], e[1]] for e in attrs["shape"]
            ]
            high = attrs.get("high")
            if high is not None and not isinstance(high, int):
                attrs["high"] = [new_index[high[0]], high[1]]
        out.nodes.append(Node(n.op, tuple(new_index[a] for a in n.args), attrs))
    out.outputs = [new_index[o] for o in g.outputs]
    out.infer()
    return out


def _freeze(g: Graph) -> Graph:
    """Input shapes spelled out (no references): for cutting nodes."""
    g = g.copy()
    for n in g.nodes:
        if n.op == "input":
            n.attrs["shape"] = list(n.shape)
            if n.attrs["kind"] == "index":
                n.attrs["high"] = int(n.hi) + 1
    return g


def _cut(g: Graph, i: int) -> Graph:
    """Node ``i`` replaced by a fresh input like it."""
    n = g.nodes[i]
    lo, hi = n.lo, n.hi
    if hi - lo < 1e-3:
        lo, hi = lo - 0.5, hi + 0.5
    if n.is_float:
        attrs = {"kind": "float", "shape": list(n.shape), "lo": lo, "hi": hi, "dtype": n.dtype}
    elif n.dtype == "bool":
        attrs = {"kind": "mask", "shape": list(n.shape), "p": 0.5}
    else:
        attrs = {"kind": "index", "shape": list(n.shape), "high": int(n.hi) + 1, "unique": None}
    g = _freeze(g)
    g.nodes[i] = Node("input", (), attrs)
    return g


def _bypass(g: Graph, i: int, a: int) -> Graph:
    g = g.copy()
    for n in g.nodes:
        n.args = tuple(a if x == i else x for x in n.args)
    g.outputs = [a if o == i else o for o in g.outputs]
    return g


def _sizes(g: Graph) -> list[tuple[int, int]]:
    """(node, entry) of every size an input's shape spells out, above 1."""
    return [
        (i, k)
        for i, n in enumerate(g.nodes)
        if n.op == "input"
        for k, e in enumerate(n.attrs["shape"])
        if isinstance(e, int) and e > 1
    ]


def same_failure(a: Outcome, b: Outcome) -> bool:
    """Two outcomes are the same failure: same status, and for errors the
    same exception type and the message's first words (numbers ignored)."""
    if a.status != b.status:
        return False
    if a.status in ("mismatch", "eager_mismatch"):
        return True

    def key(o: Outcome) -> str:
        return re.sub(r"\d+", "N", o.detail)[:60]

    return key(a) == key(b)


def minimise(
    graph: Graph,
    fails: Callable[[Graph], bool],
    budget_s: float = 300.0,
    log: Callable[[str], None] | None = None,
) -> Graph:
    """The smallest graph found (within ``budget_s``) for which ``fails`` holds."""
    deadline = time.monotonic() + budget_s
    best = graph

    def attempt(candidate: Callable[[], Graph]) -> bool:
        nonlocal best
        if time.monotonic() > deadline:
            return False
        try:
            g = prune(candidate())
        except (Invalid, KeyError, IndexError, ValueError):
            return False
        if len(g.nodes) > len(best.nodes) or (
            len(g.nodes) == len(best.nodes) and _cost(g) >= _cost(best)
        ):
            return False
        if not fails(g):
            return False
        best = g
        if log is not None:
            log(f"  minimised to {best.describe()}, {_cost(best)} elements")
        return True

    # 1. one output
    if len(best.outputs) > 1:
        for o in list(best.outputs):
            if attempt(lambda o=o: Graph(best.nodes, [o], best.seed).copy()):
                break
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        # 2. cut nodes, nearest the inputs first (drops the most)
        for i in range(len(best.nodes)):
            if i < len(best.nodes) and best.nodes[i].op != "input":
                if attempt(lambda i=i: _cut(best, i)):
                    changed = True
                    break
        if changed:
            continue
        # 3. bypass nodes
        for i, n in enumerate(best.nodes):
            hit = False
            for a in n.args:
                m = best.nodes[a]
                if n.op != "input" and m.shape == n.shape and m.dtype == n.dtype:
                    if attempt(lambda i=i, a=a: _bypass(best, i, a)):
                        hit = True
                        break
            if hit:
                changed = True
                break
        if changed:
            continue
        # 4. shrink sizes
        for i, k in _sizes(best):
            v = best.nodes[i].attrs["shape"][k]
            for w in sorted({1, v // 2, v - 1} - {v, 0}):

                def smaller(i=i, k=k, w=w):
                    g = best.copy()
                    g.nodes[i].attrs["shape"][k] = w
                    return g

                if attempt(smaller):
                    changed = True
                    break
            if changed:
                break
        if changed:
            continue
        # 5. contiguous inputs
        for i, n in enumerate(best.nodes):
            if n.op == "input" and n.attrs.get("layout", "contiguous") != "contiguous":

                def contiguous(i=i):
                    g = best.copy()
                    g.nodes[i].attrs["layout"] = "contiguous"
                    return g

                if attempt(contiguous):
                    changed = True
                    break
    return best


def _cost(g: Graph) -> int:
    return sum(n.numel for n in g.nodes)


def write_case(
    graph: Graph, outcome: Outcome, path: Path, xfail: str | None = None, dynamic: bool = False
) -> Path:
    """``graph`` as a pytest file at ``path``: compiled (and eager) on spyre
    against the CPU, at the tolerances the oracle measures now (frozen);
    ``dynamic``: compiled with ``dynamic=True``, as the fuzzer found it."""
    _, make_inputs, _ = build(graph)
    ref = reference(graph, make_inputs("cpu"))
    atols = [float(f"{a:.3g}") for a in ref.atol]
    detail = outcome.detail.replace('"""', "'''")
    mark = f"@pytest.mark.xfail(reason={xfail!r}, strict=True)\n" if xfail else ""
    text = f'''"""Found by the fuzzer (torch_spyre.tools.fuzz), minimised: {outcome.status}.

{graph.describe()}
{detail}
"""

import pytest
import torch
import torch.nn.functional as F

{graph.input_source()}

{graph.source()}
#: per output: the oracle's tolerance (torch_spyre/tools/fuzz/oracle.py), frozen
ATOL = {atols!r}


{mark}def test_case():
    torch._dynamo.reset()
    want = fn(*make_inputs("cpu"))
    eager = fn(*make_inputs("spyre"))
    got = torch.compile(fn, fullgraph=True, dynamic={dynamic})(*make_inputs("spyre"))
    for w, e, g, atol in zip(want, eager, got, ATOL):
        torch.testing.assert_close(e.cpu(), w, rtol=0, atol=atol)
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=atol)
'''
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


__all__ = ["ancestors", "minimise", "prune", "same_failure", "write_case"]
