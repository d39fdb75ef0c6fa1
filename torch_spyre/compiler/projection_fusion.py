"""An RMS norm and the projections that read it as one kernel program
(``ops/projections.py``).

``q, k, v = (rms_norm(s) @ w.T for w in (wq, wk, wv))`` (an attention
block's first half) becomes ``spyre::norm_projections(s, nw, eps, [wq, wk,
wv])``: the program norms the residual stream ``s`` in LX and streams every
weight past the same rows, so ``s`` is read once and the normed rows never
reach device memory.  Matched only when every user of the norm is such a
projection (nn.Linear without a bias, 16-bit weights) and there are at
least two: a lone projection (an LM head) keeps the matmul planner, which
fuses its epilogue; and only for 64 rows or more (``_MIN_ROWS``).  Skipped under ``planning(fusion=False)``.  Runs after
the MLP fusions (``mlp_fusion``), which take the gate and up projections
of the norm before the MLP.
"""

from __future__ import annotations

import operator

import torch

from torch_spyre.compiler.fx_match import VIEWS
from torch_spyre.compiler.fx_match import is_op as _is
from torch_spyre.compiler.fx_match import on_spyre as _on_spyre
from torch_spyre.compiler.mlp_fusion import _from_8bit
from torch_spyre.compiler.norm_match import rms_norm_of

#: fewer rows than this (a decode step's batch) keep their matmuls apart: they
#: are weight-streaming GEMVs the matmul planner runs at the weight roof, so the
#: one program saves only the norm's pass (2.7 us of a 437 us Granite-8B decode
#: layer's projections), and the programs after it lose more: with Q, K and V
#: produced at once, Inductor orders K's RoPE program between Q's rotation and
#: its epilogue, which then run apart (+9 us a layer at batch 32).
_MIN_ROWS = 64


def _projections_of(
    node: torch.fx.Node, k: int
) -> list[tuple[torch.fx.Node, torch.fx.Node]] | None:
    """(mm, weight) of every use of ``node`` when each is ``x @ w.T`` of it
    through views that keep the last dim (the rows flattened); else None."""
    found: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    todo = [node]
    while todo:
        x = todo.pop()
        for u in x.users:
            uv = u.meta.get("val")
            if _is(u, *VIEWS) and u.args[0] is x:
                if not isinstance(uv, torch.Tensor) or uv.dim() < 1 or uv.shape[-1] != k:
                    return None
                todo.append(u)
                continue
            if not (_is(u, "mm") and u.args[0] is x and len(u.args) == 2 and not u.kwargs):
                return None
            wt = u.args[1]
            if not (_is(wt, "permute") and list(wt.args[1]) == [1, 0] and len(wt.users) == 1):
                return None
            found.append((u, wt.args[0]))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=lambda f: order[f[0]])


def fuse_norm_projections(gm: torch.fx.GraphModule) -> bool:
    """``[rms_norm(s) @ w.T for w in ws]`` -> ``spyre::norm_projections``."""
    from torch_spyre.kernels import options
    from torch_spyre.kernels.projections import projection_block
    from torch_spyre.ops import projections  # noqa: F401  (registers spyre::norm_projections)

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        if not (_is(node, "mul") and _on_spyre(node)):
            continue
        seen: list = []
        found = rms_norm_of(node, seen)
        if found is None:
            continue
        s, nw, eps = found
        sv = s.meta.get("val")
        if not isinstance(sv, torch.Tensor) or sv.dim() < 2:
            continue
        k = sv.shape[-1]
        if sv.numel() // k < _MIN_ROWS:
            continue
        uses = _projections_of(node, k)
        if not uses or len(uses) < 2:
            continue
        ws = [w for _, w in uses]
        wv = [w.meta.get("val") for w in ws]
        if any(
            not isinstance(v, torch.Tensor)
            or v.dim() != 2
            or v.shape[1] != k
            or v.dtype != sv.dtype
            for v in wv
        ):
            continue
        if any(w.op not in ("placeholder", "get_attr") or _from_8bit(w) for w in ws):
            continue
        if projection_block(tuple(int(v.shape[0]) for v in wv), sv.dtype) is None:
            continue
        # the norm's own nodes feed only the norm's output
        inner = set(seen) - {node}
        if any(u not in inner and u is not node for n in inner for u in n.users):
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.spyre.norm_projections.default, (s, nw, eps, ws))
        vals = torch.ops.spyre.norm_projections.default(sv, nw.meta["val"], eps, wv)
        new.meta["val"] = vals
        last = new
        for i, (mm, _) in enumerate(uses):
            with gm.graph.inserting_after(last):
                item = gm.graph.call_function(operator.getitem, (new, i))
            item.meta["val"] = vals[i]
            with gm.graph.inserting_after(item):
                flat = gm.graph.call_function(
                    torch.ops.aten.reshape.default, (item, list(mm.meta["val"].shape))
                )
            flat.meta["val"] = vals[i].reshape(mm.meta["val"].shape)
            mm.replace_all_uses_with(flat)
            last = flat
        for mm, _ in uses:
            gm.graph.erase_node(mm)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed
