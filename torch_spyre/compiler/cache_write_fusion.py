"""A static KV cache's writes folded into the projections program.

After ``projection_fusion`` an attention block's Q, K and V come from one
``spyre::norm_projections`` program, heads-first, and after
``passes._index_put_in_place`` transformers' ``StaticLayer.update`` is two
``spyre::index_put_`` under ``auto_functionalized``: K's and V's rows copied
from the program's outputs into the cache at ``cache_position`` (two more
kernels, each reading and writing every new row once more).  When those
outputs are read by nothing else, the three become one
``spyre::norm_qkv_into_cache`` under ``auto_functionalized``: the program
stores K's and V's tiles straight into their cache rows
(``kernels.projections.Heads.cached``) and returns Q.  Inductor's
reinplacing then writes the caches in place, as it did for the puts.
"""

from __future__ import annotations

import operator

import torch


def _af_put(node: torch.fx.Node) -> bool:
    """``auto_functionalized(spyre::index_put_, ...)``."""
    return (
        node.op == "call_function"
        and node.target is torch.ops.higher_order.auto_functionalized
        and node.args
        and node.args[0] is torch.ops.spyre.index_put_.default
    )


def _named(node: torch.fx.Node, op) -> dict:
    """``node``'s arguments by the schema's names (defaults filled in)."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _sole_put(item: torch.fx.Node) -> torch.fx.Node | None:
    """The one ``auto_functionalized`` put that reads ``item``, writing it
    along dim 2 of a cache at positions ``[None, None, pos]``, or None."""
    if len(item.users) != 1:
        return None
    (put,) = item.users
    if not _af_put(put) or put.kwargs.get("values") is not item or put.kwargs.get("accumulate"):
        return None
    idx = put.kwargs.get("indices")
    if not (isinstance(idx, list | tuple) and len(idx) == 3 and idx[0] is None and idx[1] is None):
        return None
    pos = idx[2]
    pv = pos.meta.get("val") if isinstance(pos, torch.fx.Node) else None
    if not isinstance(pv, torch.Tensor) or pv.dim() != 1 or pv.is_floating_point():
        return None
    outs = [u for u in put.users if u.target is operator.getitem and u.args[1] == 1]
    if len(outs) != 1 or len(put.users) != 1:
        return None
    return put


def fuse_cache_writes(gm: torch.fx.GraphModule) -> bool:
    """``norm_projections`` (Q, K, V heads-first) + K's and V's cache puts ->
    ``spyre::norm_qkv_into_cache``."""
    from torch_spyre.kernels import options
    from torch_spyre.ops import projections  # noqa: F401  (registers the ops)

    if not options.current().fuse:
        return False
    proj_op = torch.ops.spyre.norm_projections.default
    into = torch.ops.spyre.norm_qkv_into_cache.default
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not proj_op:
            continue
        a = _named(node, proj_op)
        if len(a["ws"]) != 3 or not a["head_dim"] or list(a["heads_first"] or ()) != [True] * 3:
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if sorted(items) != [0, 1, 2] or len(node.users) != 3:
            continue
        puts = [_sole_put(items[1]), _sole_put(items[2])]
        if None in puts:
            continue
        kp, vp = puts
        pos = kp.kwargs["indices"][2]
        if vp.kwargs["indices"][2] is not pos:
            continue
        kc, vc = kp.kwargs["x"], vp.kwargs["x"]
        qv, kv, vv = (items[i].meta.get("val") for i in range(3))
        kcv, vcv = kc.meta.get("val"), vc.meta.get("val")
        if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv, kcv, vcv)):
            continue
        b, _, s, d = kv.shape
        if (
            kcv.dim() != 4
            or tuple(kcv.shape) != (b, kv.shape[1], kcv.shape[2], d)
            or tuple(vcv.shape) != (b, vv.shape[1], kcv.shape[2], d)
            or kcv.dtype != kv.dtype
            or vcv.dtype != vv.dtype
            or pos.meta["val"].shape[0] != s
        ):
            continue
        # at the earlier put, or the later one (a cache tensor may be made
        # between the two; a reader of K's cache, transformers' prefix slice
        # for a causal prefill, may come before V's put): its inputs before
        # it, every reader of what it replaces after it
        replaced = [items[0], *(next(iter(p.users)) for p in (kp, vp))]
        at = next(
            (
                put
                for put in sorted((kp, vp), key=order.__getitem__)
                if all(order[x] < order[put] for x in (kc, vc, pos))
                and all(order.get(u, -1) > order[put] for r in replaced for u in r.users)
            ),
            None,
        )
        if at is None:
            continue
        kwargs = {k: v for k, v in a.items() if k not in ("ws", "heads_first")}
        kwargs.update(wq=a["ws"][0], wk=a["ws"][1], wv=a["ws"][2], rope=list(a["rope"] or ()))
        kwargs.update(k_cache=kc, v_cache=vc, cache_position=pos)
        with gm.graph.inserting_before(at):
            af = gm.graph.call_function(torch.ops.higher_order.auto_functionalized, (into,), kwargs)
            outs = [gm.graph.call_function(operator.getitem, (af, i)) for i in range(3)]
        vals = (qv, *(next(iter(p.users)).meta["val"] for p in (kp, vp)))
        af.meta["val"] = vals
        for o, v in zip(outs, vals, strict=True):
            o.meta["val"] = v
        items[0].replace_all_uses_with(outs[0])
        for p, o in zip((kp, vp), outs[1:], strict=True):
            got = next(iter(p.users))
            got.replace_all_uses_with(o)
            gm.graph.erase_node(got)
            gm.graph.erase_node(p)
        for i in (2, 1, 0):
            gm.graph.erase_node(items[i])
        gm.graph.erase_node(node)
        changed = True
    return changed
