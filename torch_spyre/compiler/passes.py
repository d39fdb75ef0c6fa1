"""The spyre post-grad graph pass.

Inductor runs it on every graph with spyre tensors, and its ``uuid()`` (our
version and source hash) is part of the FX graph cache key.  It routes ops
that have no kernel-program lowering yet, but do have an eager device kernel,
to that kernel through a custom op (an Inductor fallback kernel that runs on
the card: counted as ``kernel``, never a host fallback):

* ``aten.embedding``: Inductor lowers it to an indirect load, which kernel
  programs cannot express yet; the eager embedding is a device DMA program.
* ``aten.index_put`` (what a static KV cache's ``index_copy_`` becomes): an
  indirect store, likewise run by the eager device kernel (a DMA program);
* ``aten.gather`` (BERT's token-type ids read through the position ids): an
  index read from data, the eager device gather (a DMA program);
* ``aten.scatter`` / ``scatter_add`` / ``scatter_reduce`` (an index written
  from data): the eager device scatter (a DMA program);
* ``aten.constant_pad_nd`` of an outer dim: the eager device pad (a DMA
  program; a pad of the last dim alone is a lane placement, below);
* ``aten.roll`` and ``aten.index`` with integer indices that are not an
  affine function of iotas (a full sliding-window cache shifted each decode
  step: ``(i + 1) % n``; ``index_select``; a paged-KV page read by a device
  index): the eager device kernels (DMA programs).  An index computed from
  iotas alone is planned as an index expression.

fuses what one kernel program does better than Inductor's groups:

* a SwiGLU MLP (separate or merged gate/up projections), with its residual
  add, becomes one ``spyre::swiglu_mlp(_add)`` program (``mlp_fusion.py``);
* scaled dot-product attention reaches the graph already as
  ``spyre::attention`` (``ops/attention.py``: registered before PyTorch's
  decomposition), one flash-attention program; its ``transpose(1, 2)
  .contiguous()`` becomes ``spyre::attention_bshd``, the program storing
  token-major;

and rewrites what the vector units cannot do into what the PE array can:

* a ``cat`` along the last dim of (negated) slices of one tensor along that
  dim — RoPE's ``rotate_half`` — is ``x @ P`` with a signed permutation matrix
  P (exact: one nonzero term per output in the fp32 accumulator), so the
  lane shuffle becomes a matmul whose epilogue (``* sin + x * cos``) fuses.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphModulePass
from torch._prims_common import is_non_overlapping_and_dense_or_false

from torch_spyre.compiler import checked_passes, implicit_fallbacks
from torch_spyre.compiler.cache_write_fusion import fuse_cache_writes
from torch_spyre.compiler.conv_routes import ROUTES as _CONV_ROUTES
from torch_spyre.compiler.fx_match import is_op as _is
from torch_spyre.compiler.fx_match import on_spyre as _on_spyre
from torch_spyre.compiler.infinities import may_be_infinite
from torch_spyre.compiler.mlp_fusion import (
    fuse_proj_swiglu,
    fuse_swiglu,
    fuse_swiglu_norm,
    fuse_swiglu_residual,
)
from torch_spyre.compiler.pool_routes import ROUTES as _POOL_ROUTES
from torch_spyre.compiler.projection_fusion import fuse_norm_projections
from torch_spyre.compiler.storage_views import view_of_computed

#: ops whose result is an affine function of iotas and constants when their inputs are
_AFFINE_OPS = {
    "iota", "arange", "full", "scalar_tensor", "add", "sub", "mul", "neg", "view", "reshape",
    "_unsafe_view", "expand", "unsqueeze", "squeeze", "permute", "clone", "_to_copy",
    "convert_element_type", "lift_fresh_copy", "alias",
}  # fmt: skip


def _affine_index(node, depth: int = 0) -> bool:
    """True when an index tensor is an affine function of iotas and constants (the
    planner reads it as an index expression: ``mask[arange(b), arange(n)]``); an
    index computed from data or through a modulo (a rolled sliding-window cache:
    ``(iota + 1) % n``) is a gather for the device kernel."""
    if not isinstance(node, torch.fx.Node) or depth > 24:
        return not isinstance(node, torch.fx.Node)
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name not in _AFFINE_OPS:
        return False
    return all(_affine_index(a, depth + 1) for a in node.all_input_nodes)


def _route_index(n: torch.fx.Node):
    """aten.index.Tensor with integer indices (a boolean mask's output size
    depends on its values: Inductor keeps those), not all affine in iotas."""
    x, indices = n.args[0], n.args[1]
    for i in indices:
        val = i.meta.get("val") if isinstance(i, torch.fx.Node) else None
        if i is not None and not (isinstance(val, torch.Tensor) and not val.dtype.is_floating_point
                                  and val.dtype is not torch.bool):  # fmt: skip
            return None
    if all(i is None or _affine_index(i) for i in indices):
        return None
    return torch.ops.spyre.index.default, (x, indices)


_ROUTED = {
    # a full sliding-window cache shifting by one position each decode step:
    # Inductor writes roll as an index (i + s) % n, which is not affine
    torch.ops.aten.roll.default: lambda n: (
        torch.ops.spyre.roll.default,
        (n.args[0], list(n.args[1]), list(n.args[2]) if len(n.args) > 2 else []),
    ),
    torch.ops.aten.index.Tensor: _route_index,
    # reflection / replication pads decompose to an index by clamped iotas
    torch.ops.aten._unsafe_index.Tensor: _route_index,
    # BERT-style token-type buffers: gather(buffer.expand(b, -1), 1, position_ids)
    torch.ops.aten.gather.default: lambda n: (
        torch.ops.spyre.gather.default,
        (n.args[0], n.args[1], n.args[2]),
    ),
    # an index written from data (scatter, scatter_add, scatter_reduce): Inductor
    # lowers them to a copy and an indirect store, which no kernel program
    # expresses (and the store, a mutation, has no FX node to run eagerly)
    torch.ops.aten.scatter.src: lambda n: (
        torch.ops.spyre.scatter.default,
        (n.args[0], n.args[1], n.args[2], n.args[3], 0.0, "none", True),
    ),
    torch.ops.aten.scatter.value: lambda n: (
        torch.ops.spyre.scatter.default,
        (n.args[0], n.args[1], n.args[2], None, float(n.args[3]), "none", True),
    ),
    torch.ops.aten.scatter_add.default: lambda n: (
        torch.ops.spyre.scatter.default,
        (n.args[0], n.args[1], n.args[2], n.args[3], 0.0, "add", True),
    ),
    torch.ops.aten.scatter_reduce.two: lambda n: (
        torch.ops.spyre.scatter.default,
        (
            *n.args[:4],
            0.0,
            n.args[4],
            n.args[5] if len(n.args) > 5 else n.kwargs.get("include_self", True),
        ),
    ),
    torch.ops.aten.embedding.default: lambda n: (
        torch.ops.spyre.embedding.default,
        (n.args[0], n.args[1]),  # padding_idx etc. only matter for the backward
    ),
    # pooling: a window loop no program expresses (compiler/pool_routes.py)
    **_POOL_ROUTES,
    # convolutions: the eager device program, in the graph's own layouts
    # (compiler/conv_routes.py)
    **_CONV_ROUTES,
}


def _copies_into(user: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Whether ``user`` is the write back of a mutated graph input into ``x``."""
    return (
        user.op == "call_function"
        and user.target is torch.ops.aten.copy_.default
        and user.args[0] is x
    )


def _clone(gm: torch.fx.GraphModule, x: torch.fx.Node, **kwargs) -> torch.fx.Node:
    """``aten.clone(x, **kwargs)`` at the graph's insertion point, with its value."""
    copy = gm.graph.call_function(torch.ops.aten.clone.default, (x,), kwargs)
    xv = x.meta.get("val")
    copy.meta["val"] = xv.clone(**kwargs) if isinstance(xv, torch.Tensor) else None
    return copy


def _index_put_in_place(gm: torch.fx.GraphModule) -> bool:
    """``aten.index_put`` (a functionalized ``index_put_`` / ``index_copy_``: a
    KV cache write) as ``spyre::index_put_`` under ``auto_functionalized``:
    Inductor's reinplacing (which runs after this pass) then writes into the
    tensor in place when nothing reads its old value after, so a cache update
    moves the new rows, not a copy of the whole cache and a copy back."""
    import operator

    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.index_put.default:
            continue
        if not _on_spyre(node):
            continue
        x, indices, values = node.args[:3]
        acc = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if any(u is not node and not _copies_into(u, x) for u in x.users):
            # another reader of the old value: Inductor may lower it lazily and
            # realize it only when the in-place write marks x mutated, after
            # the write (fuzzer seed 400362: a wrong answer); the functional
            # op keeps its own copy, made explicit: Inductor's own reinplacing
            # (torch 2.13) turned it into ``index_put_`` on ``x`` while a view
            # of ``x`` was still to be returned (fuzzer seed 6289, a wrong
            # answer on Inductor's CPU backend too)
            with gm.graph.inserting_before(node):
                node.replace_input_with(x, _clone(gm, x))
            changed = True
            continue
        with gm.graph.inserting_before(node):
            xv = x.meta.get("val")
            if isinstance(xv, torch.Tensor) and (
                not is_non_overlapping_and_dense_or_false(xv) or view_of_computed(x)
            ):
                # an expanded tensor (stride 0): the functional op's value is a
                # dense copy, and a write through the overlapping view would
                # land several elements on one location.  A view of a computed
                # tensor (``v[1]`` of a pointwise ``v``): the write through it
                # becomes an ``as_strided`` of the whole storage, which Inductor
                # reads from the view's own smaller buffer (fuzzer seed 600951)
                x = _clone(gm, x, memory_format=torch.contiguous_format)
            af = gm.graph.call_function(
                torch.ops.higher_order.auto_functionalized,
                (torch.ops.spyre.index_put_.default,),
                {"x": x, "indices": list(indices), "values": values, "accumulate": acc},
            )
            new = gm.graph.call_function(operator.getitem, (af, 1))
        af.meta["val"] = (None, node.meta["val"])
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _split_piece(p: torch.fx.Node):
    """(x, dim, start, end, 1) when ``p`` is piece i of ``split``/``split_with_sizes``
    of x (what ``chunk`` becomes), else None."""
    import operator

    aten = torch.ops.aten
    if p.op != "call_function" or p.target is not operator.getitem:
        return None
    sp, i = p.args
    if sp.op != "call_function" or sp.target not in (
        aten.split.Tensor,
        aten.split_with_sizes.default,
    ):
        return None
    x, size = sp.args[0], sp.args[1]
    dim = sp.args[2] if len(sp.args) > 2 else 0
    xv = x.meta.get("val")
    if not isinstance(xv, torch.Tensor):
        return None
    n = xv.shape[dim]
    sizes = list(size) if isinstance(size, list | tuple) else [size] * -(-n // size)
    start = sum(sizes[:i])
    return x, dim, start, min(start + sizes[i], n), 1


def _slice_pieces(cat: torch.fx.Node):
    """(x, [(sign, start, end)]) when ``cat`` joins (negated) unit-step slices
    of one tensor ``x`` along its last dim; None otherwise."""
    pieces, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    val = cat.meta.get("val")
    if not isinstance(val, torch.Tensor) or dim not in (-1, val.dim() - 1):
        return None
    src, out = None, []
    for p in pieces:
        sign = 1
        if p.op == "call_function" and p.target is torch.ops.aten.neg.default:
            sign, p = -1, p.args[0]
        got = _split_piece(p)  # x.chunk(2) / torch.split: a getitem of a split
        if got is not None:
            x, sdim, start, end, step = got
        elif p.op == "call_function" and p.target is torch.ops.aten.slice.Tensor:
            x, sdim, start, end = (list(p.args) + [0, None, None])[:4]
            step = p.args[4] if len(p.args) > 4 else 1
        else:
            return None
        xv = x.meta.get("val")
        if not isinstance(xv, torch.Tensor) or step != 1:
            return None
        if sdim not in (-1, xv.dim() - 1) or (src is not None and not _same_view(x, src)):
            return None
        d = xv.shape[-1]
        start = 0 if start is None else (start + d if start < 0 else start)
        end = d if end is None else min(end + d if end < 0 else end, d)
        src = x
        out.append((sign, start, end))
    return (src, out) if src is not None else None


#: view ops: a node of one of these over the same input with the same
#: arguments is the same value (functionalization replays a view chain for
#: each use of a mutated tensor: a LoRA projection's output, which
#: ``spyre::punica_sgmv`` writes in place, reaches each slice of RoPE's
#: rotate_half through its own reshape/permute chain)
_VIEW_OPS = (
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
)


def _same_view(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a`` and ``b`` are one value: one node, or the same view op
    with the same arguments over the same value."""
    while a is not b:
        if not (
            a.op == b.op == "call_function"
            and a.target is b.target
            and a.target in _VIEW_OPS
            and a.args[1:] == b.args[1:]
            and a.kwargs == b.kwargs
            and isinstance(a.args[0], torch.fx.Node)
            and isinstance(b.args[0], torch.fx.Node)
        ):
            return False
        a, b = a.args[0], b.args[0]
    return True


def _rewrite_lane_shuffles(gm: torch.fx.GraphModule) -> bool:
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    changed = False
    inf_memo: dict = {}  # may_be_infinite's answers: the rewrites keep every value
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        if not _on_spyre(node) or not node.meta["val"].dtype.is_floating_point:
            continue
        found = _slice_pieces(node)
        if found is None or may_be_infinite(found[0], gm, inf_memo):
            continue
        x, pieces = found
        xv = x.meta["val"]
        # sizes as ints: a symbolic one (automatic dynamic shapes) is
        # specialised with a guard, as the planner specialises every size
        d = int(xv.shape[-1])
        pieces = [(sign, int(s), int(e)) for sign, s, e in pieces]
        dout = sum(e - s for _, s, e in pieces)
        perm = torch.zeros(d, dout, dtype=xv.dtype)
        col = 0
        for sign, s, e in pieces:
            for i in range(s, e):
                perm[i, col] = sign
                col += 1
        fake_mode = detect_fake_mode([xv])
        name = f"_spyre_lane_shuffle_{len([n for n in gm.graph.nodes if n.op == 'get_attr'])}"
        gm.register_buffer(name, perm.to(xv.device))
        with gm.graph.inserting_before(node):
            p_node = gm.graph.get_attr(name)
            with fake_mode:
                p_node.meta["val"] = fake_mode.from_tensor(getattr(gm, name))
            out = _rows_matmul(gm, x, p_node, fake_mode)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


#: largest output width of a cat rewritten into lane scatters (each piece's
#: table is [piece width, output width])
_MAX_CAT = 1024


def _constant(gm: torch.fx.GraphModule, prefix: str, value: torch.Tensor, like, fake_mode):
    """A constant of the graph (a buffer of ``gm`` on the device of ``like``)."""
    name = f"{prefix}_{len([n for n in gm.graph.nodes if n.op == 'get_attr'])}"
    gm.register_buffer(name, value.to(like.device))
    node = gm.graph.get_attr(name)
    with fake_mode:
        node.meta["val"] = fake_mode.from_tensor(getattr(gm, name))
    return node


def _lane_place(gm, piece: torch.fx.Node, width: int, col: int, fake_mode) -> torch.fx.Node:
    """``piece`` [..., w] with its columns placed at ``col..col+w`` of a
    [..., width] tensor of zeros: ``piece @ E`` on the PE array."""
    pv = piece.meta["val"]
    # ints: symbolic sizes (automatic dynamic shapes) specialised with a guard
    w, width, col = int(pv.shape[-1]), int(width), int(col)
    table = torch.zeros(w, width, dtype=pv.dtype)
    table[torch.arange(w), col + torch.arange(w)] = 1
    t_node = _constant(gm, "_spyre_lane_scatter", table, pv, fake_mode)
    return _rows_matmul(gm, piece, t_node, fake_mode)


def _memory_order(v: torch.Tensor) -> list[int] | None:
    """The dims of ``v`` outermost first in memory, when ``v`` is a permutation
    of a contiguous tensor that keeps its last dim last (a head-split
    projection's ``view(b, s, h, d).transpose(1, 2)``); None otherwise."""
    if v.dim() < 2 or v.stride(-1) != 1 or not is_non_overlapping_and_dense_or_false(v):
        return None
    outer = sorted(range(v.dim() - 1), key=lambda i: (-v.stride(i), i))
    order = [*outer, v.dim() - 1]
    return order if v.permute(order).is_contiguous() else None


def _rows_matmul(gm, x: torch.fx.Node, table: torch.fx.Node, fake_mode) -> torch.fx.Node:
    """``x @ table`` over ``x``'s last dim, as one ``mm`` of ``x``'s rows.

    The rows are read where they lie: a permutation of a contiguous tensor
    that keeps the last dim last is permuted back to memory order, viewed as
    rows, and the product permuted like ``x`` (no copy of ``x``: RoPE's
    rotation of ``q.transpose(1, 2)`` reads the projection's output as it
    is). Only another layout is copied first."""
    aten = torch.ops.aten
    graph = gm.graph
    xv = x.meta["val"]
    # the table's real width (its fake value may carry a symbol for it)
    d, w = xv.shape[-1], gm.get_buffer(table.target).shape[-1]
    rows = xv.numel() // d if d else 0
    order = list(range(xv.dim())) if xv.is_contiguous() else _memory_order(xv)
    back = order is not None and order != sorted(order)
    with fake_mode:
        if order is None:
            src = graph.call_function(
                aten.clone.default, (x,), {"memory_format": torch.contiguous_format}
            )
            src.meta["val"] = sv = xv.clone(memory_format=torch.contiguous_format)
            order = list(range(xv.dim()))
        elif back:
            src = graph.call_function(aten.permute.default, (x, order))
            src.meta["val"] = sv = xv.permute(order)
        else:
            src, sv = x, xv
        flat = graph.call_function(aten.view.default, (src, [rows, d]))
        flat.meta["val"] = sv.reshape(rows, d)
        mm = graph.call_function(aten.mm.default, (flat, table))
        mm.meta["val"] = torch.mm(flat.meta["val"], table.meta["val"])
        shape = [*sv.shape[:-1], w]
        out = graph.call_function(aten.view.default, (mm, shape))
        out.meta["val"] = mm.meta["val"].view(*shape)
        if back:
            inverse = sorted(range(len(order)), key=order.__getitem__)
            out_p = graph.call_function(aten.permute.default, (out, inverse))
            out_p.meta["val"] = out.meta["val"].permute(inverse)
            return out_p
    return out


def _last_dim(node: torch.fx.Node, dim, any_width: bool = False) -> bool:
    val = node.meta.get("val")
    return (
        _on_spyre(node)
        and val.dtype.is_floating_point
        and val.dim() > 0
        and dim in (-1, val.dim() - 1)
        and (any_width or val.shape[-1] <= _MAX_CAT)
    )


def _rewrite_stick_cats(gm: torch.fx.GraphModule) -> bool:
    """``cat`` along the stick (last) dim of computed pieces, ``slice_scatter``
    into it (``x[..., a:b].copy_(y)``) and ``constant_pad_nd`` of it: Inductor writes them
    as masked loads at shifted lanes, which no stick DMA can do.  Each piece
    is placed by a lane scatter on the PE array instead (``_lane_place``:
    ``x_i @ E_i`` with ``E_i`` [d_i, d] the 0/1 table putting its columns at
    their offset; exact, one nonzero product per output): a cat is the sum of
    its placed pieces, a slice_scatter ``where(outside the slice, base,
    placed)``.  The cats of (negated) slices of one tensor (``rotate_half``)
    were rewritten before, into one permutation matmul."""
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    changed = False
    inf_memo: dict = {}  # may_be_infinite's answers: the rewrites keep every value
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target is aten.cat.default:
            dim = node.args[1] if len(node.args) > 1 else 0
            pieces = [p for p in node.args[0] if p.meta["val"].numel() > 0]
            if not _on_spyre(node) or len(pieces) < 2 or val.dim() == 0:
                continue
            if any(p.meta["val"].dtype != val.dtype for p in pieces):
                continue
            dim = dim % val.dim()
            last = dim == val.dim() - 1
            narrow = last and val.dtype.is_floating_point and val.shape[-1] <= _MAX_CAT
            narrow = narrow and not any(may_be_infinite(p, gm, inf_memo) for p in pieces)
            if not narrow:
                # along an outer dim (Inductor writes it as masked loads of
                # shifted rows, which no program expresses): whole sticks moved
                # by a DMA program; too wide for lane placement (its tables
                # would be [d_i, d]: 1 GB for a 32000-row LM head): the
                # device's cat (narrower cats stay fused lane placements)
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(torch.ops.spyre.cat.default, (pieces, dim))
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                gm.graph.erase_node(node)
                changed = True
                continue
            if any(p.meta["val"].shape[:-1] != val.shape[:-1] for p in pieces):
                continue
            fake_mode = detect_fake_mode([val])
            with gm.graph.inserting_before(node):
                total, col = None, 0
                for p in pieces:
                    placed = _lane_place(gm, p, val.shape[-1], col, fake_mode)
                    col += p.meta["val"].shape[-1]
                    if total is None:
                        total = placed
                        continue
                    prev, total = total, gm.graph.call_function(aten.add.Tensor, (total, placed))
                    with fake_mode:
                        total.meta["val"] = prev.meta["val"] + placed.meta["val"]
        elif node.target is aten.slice_scatter.default:
            base, src = node.args[0], node.args[1]
            rest = list(node.args[2:])
            dim, start, end, step = rest + [0, None, None, 1][len(rest) :]
            if not _last_dim(node, dim) or step != 1 or src.meta["val"].dtype != val.dtype:
                continue
            d = int(val.shape[-1])  # a symbolic size: specialised with a guard
            start = 0 if start is None else int(start + d if start < 0 else start)
            end = d if end is None else min(int(end + d if end < 0 else end), d)
            if src.meta["val"].shape != (*val.shape[:-1], end - start):
                continue
            if may_be_infinite(src, gm, inf_memo):
                continue  # left to Inductor's masked stores: planned or eager, never NaN
            fake_mode = detect_fake_mode([val])
            keep = torch.ones(d, dtype=torch.bool)
            keep[start:end] = False
            with gm.graph.inserting_before(node):
                placed = _lane_place(gm, src, d, start, fake_mode)
                k_node = _constant(gm, "_spyre_lane_keep", keep, val, fake_mode)
                total = gm.graph.call_function(aten.where.self, (k_node, base, placed))
                with fake_mode:
                    total.meta["val"] = torch.where(
                        k_node.meta["val"], base.meta["val"], placed.meta["val"]
                    )
        elif node.target is aten.constant_pad_nd.default:
            # a pad of the last dim (DeepSeek's value heads padded to the
            # query head size): the piece placed at its offset, the pad value
            # added on the new lanes
            x, pad = node.args[0], list(node.args[1])
            value = node.args[2] if len(node.args) > 2 else 0
            if len(pad) != 2 or min(pad) < 0 or not _on_spyre(node) or val.dim() == 0:
                continue
            if x.meta["val"].dtype != val.dtype or not isinstance(value, int | float):
                continue
            fake_mode = detect_fake_mode([val])
            if may_be_infinite(x, gm, inf_memo) or not _last_dim(node, -1):
                # a mask (-inf or bool), or too wide for a lane table: the
                # device's cat of the fill and x, whole values moved by a DMA
                # program, never multiplied by a table
                with gm.graph.inserting_before(node):
                    total = _pad_as_cat(gm, x, pad, value, val, fake_mode)
                node.replace_all_uses_with(total)
                gm.graph.erase_node(node)
                changed = True
                continue
            with gm.graph.inserting_before(node):
                total = _lane_place(gm, x, val.shape[-1], pad[0], fake_mode)
                if value:
                    width = int(val.shape[-1])
                    fill = torch.full((width,), float(value), dtype=val.dtype)
                    fill[int(pad[0]) : width - int(pad[1])] = 0
                    f_node = _constant(gm, "_spyre_pad_fill", fill, val, fake_mode)
                    placed, total = total, gm.graph.call_function(aten.add.Tensor, (total, f_node))
                    with fake_mode:
                        total.meta["val"] = placed.meta["val"] + f_node.meta["val"]
        else:
            continue
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def _pad_as_cat(gm, x: torch.fx.Node, pad: list[int], value, val, fake_mode) -> torch.fx.Node:
    """``F.pad(x, (lo, hi), value=value)`` of the last dim as ``spyre::cat`` of
    ``full(value)`` pieces and ``x``."""
    aten = torch.ops.aten
    xv = x.meta["val"]
    pieces = []
    for width, where in ((pad[0], "lo"), (None, "x"), (pad[1], "hi")):
        if where == "x":
            pieces.append(x)
            continue
        if not width:
            continue
        shape = [*(int(s) for s in xv.shape[:-1]), int(width)]  # specialised
        kw = {"dtype": xv.dtype, "device": xv.device}
        f = gm.graph.call_function(aten.full.default, (shape, value), kw)
        with fake_mode:
            f.meta["val"] = torch.full(shape, value, **kw)
        pieces.append(f)
    new = gm.graph.call_function(torch.ops.spyre.cat.default, (pieces, xv.dim() - 1))
    new.meta.update({"val": val})
    return new


def _route_outer_pads(gm: torch.fx.GraphModule) -> bool:
    """``constant_pad_nd`` of an outer dim: Inductor writes it as masked loads
    of shifted rows, which no program expresses (and when a reduction's
    lowering realizes it, a buffer with no FX node to run eagerly).  It is the
    device's pad (``spyre::pad``, a DMA program), like a cat along an outer
    dim; a pad of the last dim alone is a lane placement
    (``_rewrite_stick_cats``)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.constant_pad_nd.default:
            continue
        x, pad = node.args[0], list(node.args[1])
        value = node.args[2] if len(node.args) > 2 else 0
        if len(pad) <= 2 or not _on_spyre(node) or not isinstance(value, int | float):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.spyre.pad.default, (x, pad, float(value)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _fuse_attention_transpose(gm: torch.fx.GraphModule) -> bool:
    """``clone(permute(spyre.attention(...), [0, 2, 1, 3]))`` (the
    ``transpose(1, 2).contiguous()`` after SDPA) -> ``spyre::attention_bshd``:
    the flash program stores its output token-major, no permute pass."""
    from torch_spyre.kernels import options
    from torch_spyre.ops import attention  # noqa: F401  (registers the ops)

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        if not _is(node, "clone") or not _on_spyre(node):
            continue
        mf = node.kwargs.get("memory_format", torch.contiguous_format)
        if mf not in (torch.contiguous_format, torch.preserve_format):
            continue
        perm = node.args[0]
        if not _is(perm, "permute") or list(perm.args[1]) not in ([0, 2, 1, 3], [0, 2, 1, -1]):
            continue
        att = perm.args[0]
        if not (
            isinstance(att, torch.fx.Node)
            and att.op == "call_function"
            and att.target is torch.ops.spyre.attention.default
            and len(att.users) == 1
            and len(perm.users) == 1
        ):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_contiguous() or att.kwargs:
            continue
        new_val = torch.ops.spyre.attention_bshd.default(
            *[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in att.args]
        )
        if new_val.shape != val.shape:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.spyre.attention_bshd.default, att.args)
        new.meta["val"] = new_val
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def _key(a):
    if isinstance(a, list | tuple):
        return tuple(_key(x) for x in a)
    return a


def _dedupe_lookups(gm: torch.fx.GraphModule) -> bool:
    """One device lookup per distinct (table, indices): every decoder layer
    gathers the same rotary cos/sin rows by the same positions, and each
    lookup is its own DMA kernel (an opaque op Inductor does not CSE), so 30
    layers launched 60 gathers for 2 results."""
    lookups = {torch.ops.spyre.embedding.default, torch.ops.spyre.gather.default}
    first: dict[tuple, torch.fx.Node] = {}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in lookups:
            continue
        key = (node.target, _key(node.args), _key(tuple(sorted(node.kwargs.items()))))
        kept = first.setdefault(key, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            changed = True
    return changed


def _route_ops(gm: torch.fx.GraphModule) -> bool:
    """Every op of ``_ROUTED`` on spyre to its eager device kernel's custom op."""
    changed = False
    for node in list(gm.graph.nodes):
        route = _ROUTED.get(node.target) if node.op == "call_function" else None
        if route is None or not _on_spyre(node, tuples=True):
            continue
        routed = route(node)
        if routed is None:  # the planner serves this one itself
            continue
        target, args = routed
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    return changed


#: the sub-passes, in order (``checked_passes.run`` drops one whose rewrites
#: Inductor could not carry)
SUB_PASSES: tuple[checked_passes.SubPass, ...] = (
    ("lane shuffles", _rewrite_lane_shuffles),
    ("outer pads", _route_outer_pads),
    ("stick cats", _rewrite_stick_cats),
    ("swiglu", fuse_swiglu),
    ("swiglu residual", fuse_swiglu_residual),
    ("swiglu norm", fuse_swiglu_norm),
    ("proj swiglu", fuse_proj_swiglu),
    ("norm projections", fuse_norm_projections),
    ("attention transpose", _fuse_attention_transpose),
    ("index_put in place", _index_put_in_place),
    ("cache writes", fuse_cache_writes),
    ("routes", _route_ops),
    ("lookups", _dedupe_lookups),
)


class SpyreGraphPass(CustomGraphModulePass):
    def __call__(self, gm: torch.fx.GraphModule) -> None:
        if checked_passes.run(gm, SUB_PASSES):
            gm.graph.lint()
            gm.recompile()
        implicit_fallbacks.prepare(gm)  # every graph lowers as the first one did

    def uuid(self) -> str:
        from torch_spyre.compiler import backend_version
        from torch_spyre.kernels import options

        # planning options (naive plans, fewer cores) shape the code too
        return "torch_spyre.compiler:" + backend_version() + ":" + options.current().key()
