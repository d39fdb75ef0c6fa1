"""The spyre post-grad graph pass.

Inductor runs it on every graph with spyre tensors, and its ``uuid()`` (our
version and source hash) is part of the FX graph cache key.  It routes ops
that have no kernel-program lowering yet, but do have an eager device kernel,
to that kernel through a custom op (an Inductor fallback kernel that runs on
the card: counted as ``kernel``, never a host fallback):

* ``aten.embedding``: Inductor lowers it to an indirect load, which kernel
  programs cannot express yet; the eager embedding is a device DMA program.
* ``aten.index_put`` (what a static KV cache's ``index_copy_`` becomes): an
  indirect store, likewise run by the eager device kernel (a DMA program).

and rewrites what the vector units cannot do into what the PE array can:

* a ``cat`` along the last dim of (negated) slices of one tensor along that
  dim — RoPE's ``rotate_half`` — is ``x @ P`` with a signed permutation matrix
  P (exact: one nonzero term per output in the fp32 accumulator), so the
  lane shuffle becomes a matmul whose epilogue (``* sin + x * cos``) fuses.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphModulePass


@torch.library.custom_op("spyre::embedding", mutates_args=())
def embedding(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``F.embedding(indices, weight)`` by the device's eager kernel."""
    return torch.nn.functional.embedding(indices, weight)


@embedding.register_fake
def _(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*indices.shape, weight.shape[-1]))


@torch.library.custom_op("spyre::index_put", mutates_args=())
def index_put(
    x: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor, accumulate: bool
) -> torch.Tensor:
    """``x.index_put(indices, values, accumulate)`` by the device's eager kernel."""
    return torch.ops.aten.index_put.default(x, indices, values, accumulate)


@index_put.register_fake
def _(x, indices, values, accumulate):
    return torch.empty_like(x)


_ROUTED = {
    torch.ops.aten.embedding.default: lambda n: (
        torch.ops.spyre.embedding.default,
        (n.args[0], n.args[1]),  # padding_idx etc. only matter for the backward
    ),
    torch.ops.aten.index_put.default: lambda n: (
        torch.ops.spyre.index_put.default,
        (n.args[0], n.args[1], n.args[2], n.args[3] if len(n.args) > 3 else False),
    ),
}


def _on_spyre(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "spyre"


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
        if p.op != "call_function" or p.target is not torch.ops.aten.slice.Tensor:
            return None
        x, sdim, start, end = (list(p.args) + [0, None, None])[:4]
        step = p.args[4] if len(p.args) > 4 else 1
        xv = x.meta.get("val")
        if not isinstance(xv, torch.Tensor) or step != 1:
            return None
        if sdim not in (-1, xv.dim() - 1) or (src is not None and x is not src):
            return None
        d = xv.shape[-1]
        start = 0 if start is None else (start + d if start < 0 else start)
        end = d if end is None else min(end + d if end < 0 else end, d)
        src = x
        out.append((sign, start, end))
    return (src, out) if src is not None else None


def _rewrite_lane_shuffles(gm: torch.fx.GraphModule) -> bool:
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        if not _on_spyre(node) or not node.meta["val"].dtype.is_floating_point:
            continue
        found = _slice_pieces(node)
        if found is None:
            continue
        x, pieces = found
        xv = x.meta["val"]
        d = xv.shape[-1]
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
        rows = xv.numel() // d
        with gm.graph.inserting_before(node):
            p_node = gm.graph.get_attr(name)
            src = x
            if not xv.is_contiguous():
                src = gm.graph.call_function(
                    aten.clone.default, (x,), {"memory_format": torch.contiguous_format}
                )
            flat = gm.graph.call_function(aten.view.default, (src, [rows, d]))
            mm = gm.graph.call_function(aten.mm.default, (flat, p_node))
            out = gm.graph.call_function(aten.view.default, (mm, list(xv.shape[:-1]) + [dout]))
        with fake_mode:
            pv = fake_mode.from_tensor(getattr(gm, name))
            p_node.meta["val"] = pv
            sv = xv.clone(memory_format=torch.contiguous_format) if src is not x else xv
            if src is not x:
                src.meta["val"] = sv
            flat.meta["val"] = sv.view(rows, d)
            mm.meta["val"] = torch.mm(flat.meta["val"], pv)
            out.meta["val"] = mm.meta["val"].view(*xv.shape[:-1], dout)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


class SpyreGraphPass(CustomGraphModulePass):
    def __call__(self, gm: torch.fx.GraphModule) -> None:
        changed = _rewrite_lane_shuffles(gm)
        for node in list(gm.graph.nodes):
            route = _ROUTED.get(node.target) if node.op == "call_function" else None
            if route is None or not _on_spyre(node):
                continue
            target, args = route(node)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(target, args)
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()

    def uuid(self) -> str:
        from torch_spyre.compiler import backend_version, options

        # planning options (naive plans, fewer cores) shape the code too
        return "torch_spyre.compiler:" + backend_version() + ":" + options.current().key()
