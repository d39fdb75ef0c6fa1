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
from dataclasses import dataclass

import torch

from torch_spyre.compiler import rope_match
from torch_spyre.compiler.fx_match import VIEWS
from torch_spyre.compiler.fx_match import is_op as _is
from torch_spyre.compiler.fx_match import on_spyre as _on_spyre
from torch_spyre.compiler.mlp_fusion import _from_8bit, _row_slice, _slice_span
from torch_spyre.compiler.mlp_fusion import _val as _weight_val
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


def _row_pieces(mm: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int]] | None:
    """(node, lo, hi) of each piece when ``mm``'s output [..., N] is read only
    as consecutive last-dim pieces covering it (``split_with_sizes`` or
    slices: vLLM's merged ``qkv_proj`` split into Q, K and V), so that piece
    ``i`` is the projection by rows ``lo:hi`` of the weight; else None."""
    mv = mm.meta.get("val")
    if not isinstance(mv, torch.Tensor) or mv.dim() < 1:
        return None
    width, rank = int(mv.shape[-1]), mv.dim()
    pieces: list[tuple[torch.fx.Node, int, int]] = []
    for u in mm.users:
        if _is(u, "split_with_sizes") and u.args[0] is mm and not u.kwargs:
            dim = u.args[2] if len(u.args) > 2 else 0
            if dim not in (-1, rank - 1):
                return None
            bounds = [0]
            for size in u.args[1]:
                bounds.append(bounds[-1] + int(size))
            for g in u.users:
                if g.target is not operator.getitem:
                    return None
                i = g.args[1]
                pieces.append((g, bounds[i], bounds[i + 1]))
        elif _is(u, "slice") and u.args[0] is mm:
            span = _slice_span(u, width)
            if span is None:
                return None
            pieces.append((u, *span))
        else:
            return None
    pieces.sort(key=lambda p: p[1])
    at = 0
    for _, lo, hi in pieces:
        if lo != at or hi <= lo:
            return None
        at = hi
    return pieces if at == width and len(pieces) > 1 else None


@dataclass
class _Heads:
    """How a fused projection's outputs are read as attention heads."""

    dim: int
    rope: list[bool]
    first: list[bool]
    cos: torch.fx.Node | None
    sin: torch.fx.Node | None
    #: the node each output stands for (its transpose, or its rotated sum), or None
    stands: list[torch.fx.Node | None]
    #: each output's head-norm weight node, or None; their one epsilon
    norms: list[torch.fx.Node | None]
    norm_eps: float

    def args(self) -> tuple:
        normed = [w is not None for w in self.norms]
        weights = [w for w in self.norms if w is not None]
        return (self.cos, self.sin, self.dim, self.rope, self.first, weights or None,
                normed if weights else None, self.norm_eps)  # fmt: skip


def _as_heads(gm: torch.fx.GraphModule, mms: list[torch.fx.Node], sv: torch.Tensor):
    """How the projections ``mms`` of ``sv`` [b, s, k] are read as attention
    heads (``_Heads``), or None when none is a head split.

    An output read only as ``view(b, s, -1, d).transpose(1, 2)`` is stored
    heads-first (contiguous: what attention and a KV cache read) and replaces
    the transpose; a per-head RMS norm before the transpose (Qwen3's q_norm
    and k_norm, one epsilon for all) is done by the program too; when the
    transpose is read only as transformers' RoPE (one cos/sin pair for all),
    the program also rotates it and it replaces the sum.  One head size for
    all, half a head whole sticks."""

    if sv.dim() != 3:
        return None
    b, s = sv.shape[0], sv.shape[1]
    splits = [rope_match.head_split(mm, b, s) for mm in mms]
    # head norms: 16-bit-matching weights [d] and one epsilon, else not fused
    epss = {f[2][1] for f in splits if f is not None and f[2] is not None}
    splits = [
        f
        if f is None
        or f[2] is None
        or (
            len(epss) == 1
            and isinstance(f[2][0].meta.get("val"), torch.Tensor)
            and f[2][0].meta["val"].dtype == sv.dtype
            and tuple(f[2][0].meta["val"].shape) == (f[1],)
        )
        else None
        for f in splits
    ]
    hd = _head_size({f[1] for f in splits if f is not None}, mms, sv.dtype)
    if hd is None:
        return None
    ropes = [rope_match.rope_of(gm, f[0], hd) if f is not None else None for f in splits]
    tables = {(r[1], r[2]) for r in ropes if r is not None}
    ok = len(tables) == 1 and all(
        r is None or (r[0].meta["val"].dtype == sv.dtype and r[1].meta["val"].dtype == sv.dtype)
        for r in ropes
    )
    if not ok:
        ropes = [None] * len(mms)
    cos, sin = next(iter(tables)) if ok else (None, None)
    # heads-first (contiguous) for an output not rotated here only where its
    # readers take the value whatever its strides
    splits = [
        f if f is None or r is not None or rope_match.layout_free(f[0]) else None
        for f, r in zip(splits, ropes)
    ]
    if not any(splits):
        return None
    stands = [
        (r[0] if r is not None else f[0]) if f is not None else None for f, r in zip(splits, ropes)
    ]
    norms = [f[2][0] if f is not None and f[2] is not None else None for f in splits]
    norm_eps = float(next(iter(epss))) if any(n is not None for n in norms) else 0.0
    return _Heads(
        hd, [r is not None for r in ropes], [f is not None for f in splits], cos, sin, stands,
        norms, norm_eps,
    )  # fmt: skip


def _head_size(sizes: set[int], mms: list[torch.fx.Node], dtype: torch.dtype) -> int | None:
    """The one head size of the outputs read as heads, when half a head is
    whole sticks and every output whole heads; else None."""
    from torch_spyre.layout import stick_elems

    if len(sizes) != 1:
        return None
    (hd,) = sizes
    if hd % 2 or (hd // 2) % stick_elems(dtype):
        return None
    if any(mm.meta["val"].shape[-1] % hd for mm in mms):
        return None
    return hd


def _as_token_heads(gm: torch.fx.GraphModule, mms: list[torch.fx.Node], sv: torch.Tensor):
    """vLLM's form of ``_as_heads``: ``sv`` [t, k], an output read only as
    ``view(t, -1, d)`` rotated by tables [t, d] gathered by position
    (``rope_match.rope_of(token_major=True)``; one pair for all) is rotated by
    the program and stored token-major, replacing the sum; the others stay
    plain projections.  None when no output is rotated so."""

    if sv.dim() != 2:
        return None
    views = [rope_match.token_heads(mm, sv.shape[0]) for mm in mms]
    hd = _head_size({v[1] for v in views if v is not None}, mms, sv.dtype)
    if hd is None:
        return None
    ropes = [
        rope_match.rope_of(gm, v[0], hd, token_major=True) if v is not None else None for v in views
    ]
    tables = {(r[1], r[2]) for r in ropes if r is not None}
    if len(tables) != 1:
        return None
    cos, sin = next(iter(tables))
    if not (cos.meta["val"].dtype == sin.meta["val"].dtype == sv.dtype):
        return None
    n = len(mms)
    return _Heads(
        hd, [r is not None for r in ropes], [False] * n, cos, sin,
        [r[0] if r is not None else None for r in ropes], [None] * n, 0.0,
    )  # fmt: skip


def _val_of(a):
    """A node argument's value (fake), lists element-wise; anything else as is."""
    if isinstance(a, torch.fx.Node):
        return a.meta["val"]
    if isinstance(a, list):
        return [_val_of(x) for x in a]
    return a


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
        if not uses:
            continue
        # a merged projection read as pieces: one projection per piece, by
        # its rows of the weight (a (weight, lo, hi) row slice)
        split_up: list = []
        for mm, w in uses:
            pieces = _row_pieces(mm)
            split_up += [(p, (w, lo, hi)) for p, lo, hi in pieces] if pieces else [(mm, w)]
        merged = len(split_up) > len(uses)
        uses = split_up
        if len(uses) < 2:
            continue
        ws = [w for _, w in uses]
        wv = [_weight_val(w) for w in ws]
        if any(
            not isinstance(v, torch.Tensor)
            or v.dim() != 2
            or v.shape[1] != k
            or v.dtype != sv.dtype
            for v in wv
        ):
            continue
        bases = [w[0] if isinstance(w, tuple) else w for w in ws]
        if any(w.op not in ("placeholder", "get_attr") or _from_8bit(w) for w in bases):
            continue
        if projection_block(tuple(int(v.shape[0]) for v in wv), sv.dtype) is None:
            continue
        # the norm's own nodes feed only the norm's output
        inner = set(seen) - {node}
        if any(u not in inner and u is not node for n in inner for u in n.users):
            continue
        # rows [t, k] (vLLM): token-major heads, rotated; [b, s, k]
        # (transformers, separate weights): heads-first, rotated, normed
        mms = [mm for mm, _ in uses]
        if sv.dim() == 2:
            heads = _as_token_heads(gm, mms, sv)
        else:
            heads = None if merged else _as_heads(gm, mms, sv)
        at = node
        if heads is not None:
            # the op reads the rotary tables and head-norm weights: it goes
            # after them, so every node it replaces must be read only after that
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            reads = [x for x in (heads.cos, heads.sin, *heads.norms) if x is not None]
            at = max((node, *reads), key=order.__getitem__)
            replaced = [st if st is not None else mm for st, (mm, _) in zip(heads.stands, uses)]
            if any(order[u] <= order[at] for r in replaced for u in r.users):
                heads, at = None, node  # read before the tables: the plain projections
        with gm.graph.inserting_before(at):
            ws = [_row_slice(gm, w) for w in ws]
        args: tuple = (s, nw, eps, ws)
        vargs: tuple = (sv, nw.meta["val"], eps, wv)
        if heads is not None:
            extra = heads.args()
            args += extra
            vargs += tuple(_val_of(a) for a in extra)
        with gm.graph.inserting_after(at):
            new = gm.graph.call_function(torch.ops.spyre.norm_projections.default, args)
        vals = torch.ops.spyre.norm_projections.default(*vargs)
        new.meta["val"] = vals
        last = new
        for i, (mm, _) in enumerate(uses):
            with gm.graph.inserting_after(last):
                item = gm.graph.call_function(operator.getitem, (new, i))
            item.meta["val"] = vals[i]
            last = item
            if heads is not None and heads.stands[i] is not None:
                # heads-first (normed, rotated): the node it stands for,
                # replaced; the projection's views to it are dead (a
                # token-major output [t, n] stands for its [t, h, d] view)
                stand = heads.stands[i]
                shape = list(stand.meta["val"].shape)
                if list(vals[i].shape) != shape:
                    with gm.graph.inserting_after(item):
                        item = gm.graph.call_function(torch.ops.aten.reshape.default, (item, shape))
                    item.meta["val"] = vals[i].reshape(shape)
                    last = item
                stand.replace_all_uses_with(item)
                continue
            with gm.graph.inserting_after(item):
                flat = gm.graph.call_function(
                    torch.ops.aten.reshape.default, (item, list(mm.meta["val"].shape))
                )
            flat.meta["val"] = vals[i].reshape(mm.meta["val"].shape)
            mm.replace_all_uses_with(flat)
            gm.graph.erase_node(mm)
            last = flat
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed
