"""The SwiGLU MLP of a compiled graph as one kernel program (``ops/mlp.py``).

* ``mm(silu(x @ wg.T) * (x @ wu.T), wd.T)`` becomes ``spyre::swiglu_mlp``: gate
  and up projections in one program sharing the activation tile, their
  epilogue in LX and the down projection fed from LX;
* the same with one merged gate/up projection, ``y = x @ wgu.T`` and
  ``silu(y[..., :n]) * y[..., n:]`` (vLLM's ``gate_up_proj`` + ``SiluAndMul``):
  the two row halves of ``wgu`` are the gate and up weights, read in place;
* a residual add of its output (``res + mlp``, ``res + mlp * c``) becomes
  ``spyre::swiglu_mlp_add``, the add as the down projection's epilogue.

Skipped under ``planning(fusion=False)`` / naive plans, and for 8-bit weights.
"""

from __future__ import annotations

import torch

from torch_spyre.compiler.fx_match import base as _base
from torch_spyre.compiler.fx_match import is_op as _is
from torch_spyre.compiler.fx_match import on_spyre as _on_spyre
from torch_spyre.compiler.fx_match import through_views as _through_views
from torch_spyre.compiler.norm_match import rms_norm_of


def _silu_input(node, seen: list):
    """x when ``node`` computes silu(x) (as aten.silu, x * sigmoid(x) or
    Inductor's x / (1 + exp(-x))), modulo casts; else None."""
    node = _through_views(node, seen)
    if _is(node, "silu"):
        seen.append(node)
        return node.args[0]
    if _is(node, "mul") and len(node.args) == 2:
        a, b = node.args
        for x, sg in ((a, b), (b, a)):
            if _is(sg, "sigmoid") and sg.args[0] is x:
                seen += [node, sg]
                return x
    if _is(node, "div") and len(node.args) == 2:
        x, den = node.args
        if _is(den, "add") and 1 in den.args:
            e = next(a for a in den.args if a != 1)
            if _is(e, "exp") and _is(e.args[0], "neg") and e.args[0].args[0] is x:
                seen += [node, den, e, e.args[0]]
                return x
    return None


def _linear_of(node, seen: list):
    """(x, weight) when ``node`` is ``x @ weight.T`` (an mm with a permuted
    2-D weight), modulo views and casts; else None."""
    node = _through_views(node, seen)
    if not _is(node, "mm"):
        return None
    x, wt = node.args
    if not (_is(wt, "permute") and list(wt.args[1]) == [1, 0]):
        return None
    seen += [node, wt]
    return x, wt.args[0]


_EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)


def _from_8bit(node, depth: int = 6) -> bool:
    """Whether ``node`` is computed (within a few ops) from 8-bit data: a
    quantised weight's dequantisation."""
    todo, seen = [(node, 0)], set()
    while todo:
        n, d = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or d > depth:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if n is not node and isinstance(val, torch.Tensor) and val.dtype in _EIGHT_BIT:
            return True
        todo += [(a, d + 1) for a in n.all_input_nodes]
    return False


def _slice_span(node, width: int) -> tuple[int, int] | None:
    """(start, end) of ``aten.slice`` ``node`` along the last of ``width``
    columns, step 1; else None."""
    given = tuple(node.args[1:])
    dim, start, end, step = given + (0, None, None, 1)[len(given) :]
    rank = node.args[0].meta["val"].dim()
    if dim not in (-1, rank - 1) or step != 1:
        return None
    start = 0 if start is None else start
    end = width if end is None or end > width else end
    return (start, end) if 0 <= start <= end else None


def _merged_halves(a, b, seen: list):
    """((x, (w, 0, n)), (x, (w, n, 2n))) when ``a`` is ``silu(y[..., :n])`` and
    ``b`` is ``y[..., n:]`` of one ``y = x @ w.T`` with ``w`` [2n, K] (vLLM's
    merged gate/up projection and ``SiluAndMul``): the gate and up weights are
    row slices of ``w``; else None."""
    g = _silu_input(a, seen)
    if g is None:
        return None
    gs, us = _through_views(g, seen), _through_views(b, seen)
    if not (_is(gs, "slice") and _is(us, "slice")) or gs.args[0] is not us.args[0]:
        return None
    yv = gs.args[0].meta.get("val")
    if not isinstance(yv, torch.Tensor) or yv.dim() < 1 or yv.shape[-1] % 2:
        return None
    width = yv.shape[-1]
    n = width // 2
    if _slice_span(gs, width) != (0, n) or _slice_span(us, width) != (n, width):
        return None
    lin = _linear_of(gs.args[0], seen)
    if lin is None:
        return None
    x, w = lin
    seen += [gs, us]
    return (x, (w, 0, n)), (x, (w, n, width))


def _weight_node(w):
    return w[0] if isinstance(w, tuple) else w


def _val(w):
    """The fake value of a weight node, or of a (node, start, end) row slice."""
    if isinstance(w, tuple):
        node, lo, hi = w
        return node.meta["val"][lo:hi]
    return w.meta.get("val")


def _row_slice(gm: torch.fx.GraphModule, w):
    """A weight node; a (node, start, end) row slice becomes an ``aten.slice``
    node (a view: the MLP op reads the two halves in place, ops/mlp.py)."""
    if not isinstance(w, tuple):
        return w
    node, lo, hi = w
    out = gm.graph.call_function(torch.ops.aten.slice.Tensor, (node, 0, lo, hi))
    out.meta["val"] = _val(w)
    return out


def fuse_swiglu(gm: torch.fx.GraphModule) -> bool:
    """``mm(silu(x @ wg.T) * (x @ wu.T), wd.T)`` -> ``spyre::swiglu_mlp``: one
    program with both matmuls on the shared activation, the epilogue in LX
    and the down projection fed from LX (``ops/mlp.py``)."""
    from torch_spyre.kernels import options
    from torch_spyre.ops import mlp  # noqa: F401  (registers spyre::swiglu_mlp)

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        res = None  # addmm(res, h, wd.T): what ``res + mlp`` of 2-D rows becomes
        if _is(node, "addmm") and _on_spyre(node) and len(node.args) == 3 and not node.kwargs:
            rv, ov = node.args[0].meta.get("val"), node.meta["val"]
            if not isinstance(rv, torch.Tensor) or rv.shape != ov.shape or rv.dtype != ov.dtype:
                continue
            res = node.args[0]
            wt = node.args[2]
            if not (_is(wt, "permute") and list(wt.args[1]) == [1, 0]):
                continue
            down = (node.args[1], wt.args[0])
        elif _is(node, "mm") and _on_spyre(node):
            down = _linear_of(node, [])
        else:
            continue
        seen: list = [node]
        if down is None:
            continue
        h, wd = down
        seen.append(node.args[-1])
        prod = _through_views(h, seen)
        if not _is(prod, "mul") or len(prod.args) != 2:
            continue
        seen.append(prod)
        found = None
        for a, b in (prod.args, prod.args[::-1]):
            s2: list = []
            g = _silu_input(a, s2)
            gl = _linear_of(g, s2) if g is not None else None
            ul = _linear_of(b, s2)
            if gl and ul and _base(gl[0]) is _base(ul[0]):
                found, seen = (gl, ul), seen + s2
                break
            s2 = []
            halves = _merged_halves(a, b, s2)
            if halves is not None:
                found, seen = halves, seen + s2
                break
        if found is None:
            continue
        (xg, wg), (xu, wu) = found
        if any(_from_8bit(_weight_node(w)) for w in (wg, wu, wd)):
            # quantised weights: three matmuls, each dequantising its weight in
            # LX (compiler/matmuls.py); the MLP program reads 16-bit weights
            continue
        x = _base(xg)
        xv, wv = x.meta.get("val"), [_val(w) for w in (wg, wu, wd)]
        if not isinstance(xv, torch.Tensor) or any(not isinstance(w, torch.Tensor) for w in wv):
            continue
        k = xv.shape[-1]
        if (
            wv[0].shape != wv[1].shape
            or wv[0].dim() != 2
            or wv[0].shape[1] != k
            or wv[2].shape[1] != wv[0].shape[0]
            or len({xv.dtype, *(w.dtype for w in wv)}) != 1
            or xv.dim() < 2
        ):
            continue
        # every intermediate must be used only inside the pattern
        inner = set(seen) - {node}
        if any(u not in inner and u is not node for n in inner for u in n.users):
            continue
        oshape = (*xv.shape[:-1], wv[2].shape[0])
        with gm.graph.inserting_before(node):
            wg, wu = _row_slice(gm, wg), _row_slice(gm, wu)
            if res is None:
                new = gm.graph.call_function(torch.ops.spyre.swiglu_mlp.default, (x, wg, wu, wd))
            else:
                r = gm.graph.call_function(torch.ops.aten.reshape.default, (res, list(oshape)))
                new = gm.graph.call_function(
                    torch.ops.spyre.swiglu_mlp_add.default, (x, wg, wu, wd, r, 1.0)
                )
            flat = gm.graph.call_function(
                torch.ops.aten.reshape.default, (new, list(node.meta["val"].shape))
            )
        if res is None:
            val = torch.ops.spyre.swiglu_mlp.default(xv, *wv)
        else:
            r.meta["val"] = res.meta["val"].reshape(oshape)
            val = torch.ops.spyre.swiglu_mlp_add.default(xv, *wv, r.meta["val"], 1.0)
        new.meta["val"] = val
        flat.meta["val"] = val.reshape(node.meta["val"].shape)
        node.replace_all_uses_with(flat)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def _residual_terms(add: torch.fx.Node):
    """``(res, c, t, seen)`` for each way ``add`` reads as ``res + t * c`` (a
    decoder layer's residual add, Granite's residual multiplier ``c`` a
    constant) or ``res + t`` (``c`` = 1); ``seen``: the mul, if any."""
    for res, other in (add.args, add.args[::-1]):
        if _is(other, "mul") and len(other.args) == 2 and not other.kwargs:
            c = [a for a in other.args if isinstance(a, (int, float))]
            t = [a for a in other.args if isinstance(a, torch.fx.Node)]
            if len(c) != 1 or len(t) != 1:
                continue
            yield res, float(c[0]), t[0], [other]
        else:
            yield res, 1.0, other, []


def fuse_swiglu_residual(gm: torch.fx.GraphModule) -> bool:
    """``res + swiglu_mlp(...)`` and ``res + swiglu_mlp(...) * c`` (a decoder
    layer's residual add, with Granite's residual multiplier) ->
    ``spyre::swiglu_mlp_add``: the add is the down projection's epilogue, so
    the MLP output never makes a separate pass through device memory."""
    from torch_spyre.kernels import options
    from torch_spyre.ops import mlp  # noqa: F401  (registers spyre::swiglu_mlp_add)

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        if not _is(node, "add") or len(node.args) != 2 or node.kwargs or not _on_spyre(node):
            continue
        found = None
        for res, scale, other, seen in _residual_terms(node):
            mlp_node = _through_views(other, seen)
            if (
                isinstance(res, torch.fx.Node)
                and isinstance(mlp_node, torch.fx.Node)
                and mlp_node.op == "call_function"
                and mlp_node.target is torch.ops.spyre.swiglu_mlp.default
            ):
                found = (res, scale, mlp_node, seen)
                break
        if found is None:
            continue
        res, scale, mlp_node, seen = found
        rv, ov, mv = res.meta.get("val"), node.meta.get("val"), mlp_node.meta.get("val")
        if not all(isinstance(v, torch.Tensor) for v in (rv, ov, mv)):
            continue
        if rv.shape != ov.shape or rv.dtype != ov.dtype != mv.dtype or ov.numel() != mv.numel():
            continue
        if ov.dtype != mv.dtype:
            continue
        # the MLP output and the views between must feed only this add
        inner = [mlp_node, *seen]
        if any(u not in inner and u is not node for n in inner for u in n.users):
            continue
        with gm.graph.inserting_before(node):
            r = gm.graph.call_function(torch.ops.aten.reshape.default, (res, list(mv.shape)))
            new = gm.graph.call_function(
                torch.ops.spyre.swiglu_mlp_add.default, (*mlp_node.args, r, scale)
            )
            flat = gm.graph.call_function(torch.ops.aten.reshape.default, (new, list(ov.shape)))
        r.meta["val"] = rv.reshape(mv.shape)
        val = torch.ops.spyre.swiglu_mlp_add.default(
            *[a.meta["val"] for a in mlp_node.args], r.meta["val"], scale
        )
        new.meta["val"] = val
        flat.meta["val"] = val.reshape(ov.shape)
        node.replace_all_uses_with(flat)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def fuse_swiglu_norm(gm: torch.fx.GraphModule) -> bool:
    """``swiglu_mlp_add(rms_norm(s), ..., res=s)`` (a decoder layer's second
    half: the norm of its residual stream, the MLP, the residual add) ->
    ``spyre::swiglu_mlp_norm_add(s, ...)``: the norm is the MLP program's
    prologue in LX, so the normed activation never makes a pass through
    device memory, and the add producing ``s`` is left alone for the
    scheduler to fuse into the matmul before it."""
    from torch_spyre.kernels import options
    from torch_spyre.ops import mlp  # noqa: F401  (registers spyre::swiglu_mlp_norm_add)

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        if not (
            node.op == "call_function" and node.target is torch.ops.spyre.swiglu_mlp_add.default
        ):
            continue
        x, wg, wu, wd, res, scale = node.args
        seen: list = []
        found = rms_norm_of(_through_views(x, seen), seen)
        if found is None or _base(found[0]) is not _base(res):
            continue
        s, nw, eps = found
        xv, sv, ov = x.meta.get("val"), s.meta.get("val"), node.meta.get("val")
        if not all(isinstance(v, torch.Tensor) for v in (xv, sv, ov)):
            continue
        if sv.numel() != xv.numel() or ov.shape != xv.shape or sv.dtype != xv.dtype:
            continue
        # the norm's nodes must feed only this MLP
        inner = set(seen)
        if any(u not in inner and u is not node for n in inner for u in n.users):
            continue
        with gm.graph.inserting_before(node):
            sx = gm.graph.call_function(torch.ops.aten.reshape.default, (s, list(xv.shape)))
            new = gm.graph.call_function(
                torch.ops.spyre.swiglu_mlp_norm_add.default, (sx, nw, eps, wg, wu, wd, scale)
            )
        sx.meta["val"] = sv.reshape(xv.shape)
        new.meta["val"] = torch.ops.spyre.swiglu_mlp_norm_add.default(
            sx.meta["val"], _val(nw), eps, _val(wg), _val(wu), _val(wd), scale
        )
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def fuse_proj_swiglu(gm: torch.fx.GraphModule) -> bool:
    """``swiglu_mlp_norm_add(res + (a @ wo.T) * so, ...)`` (a decoder layer's
    second half from its attention output: the output projection, its
    residual add, then the norm, MLP and residual add) ->
    ``spyre::proj_swiglu_mlp_norm_add(a, wo, res, so, ...)``, one program
    whose residual stream stays in LX, where the cost model says it is
    faster than the projection and the MLP apart (``kernels.swiglu.
    proj_pays``: prefill yes, a decode step no)."""
    from torch_spyre.kernels import options
    from torch_spyre.kernels.swiglu import proj_pays
    from torch_spyre.ops import mlp  # noqa: F401  (registers the op)
    from torch_spyre.runtime import cards

    if not options.current().fuse:
        return False
    changed = False
    for node in list(gm.graph.nodes):
        if not (
            node.op == "call_function"
            and node.target is torch.ops.spyre.swiglu_mlp_norm_add.default
        ):
            continue
        x, nw, eps, wg, wu, wd, scale = node.args
        seen: list = []
        s = _through_views(x, seen)
        if not _is(s, "add") or len(s.args) != 2 or s.kwargs:
            continue
        found = None
        for res, so, other, inner in _residual_terms(s):
            lin = _linear_of(other, inner) if isinstance(res, torch.fx.Node) else None
            if lin is not None:
                found = (res, so, lin, inner)
                break
        if found is None:
            continue
        res, so, (a, wo), inner = found
        # a weight of the model (not computed: an 8-bit weight's dequantisation)
        if wo.op not in ("placeholder", "get_attr") or _from_8bit(wo):
            continue
        rv, av, wv, ov = (v.meta.get("val") for v in (res, a, wo, node))
        if not all(isinstance(v, torch.Tensor) for v in (rv, av, wv, ov)):
            continue
        kk, jj = wv.shape if wv.dim() == 2 else (None, None)
        if (
            kk is None
            or av.dim() != 2
            or av.shape[-1] != jj
            or rv.numel() != av.shape[0] * kk
            or ov.numel() != rv.numel()
            or not (rv.dtype == av.dtype == wv.dtype == ov.dtype)
        ):
            continue
        # the stream and the nodes computing it must feed only this MLP
        chain = [s, *seen, *inner]
        if any(u not in chain and u is not node for c in chain for u in c.users):
            continue
        rows = rv.shape[:-1] if rv.dim() == 3 else (1, av.shape[0])
        b, m = int(rows[0]), int(rows[1])
        if b * m != av.shape[0]:
            continue
        nv = wg.meta.get("val") if isinstance(wg, torch.fx.Node) else None
        if not isinstance(nv, torch.Tensor):
            continue
        cfg = cards.config(rv.device.index or 0)
        if not proj_pays(b, m, kk, nv.shape[0], jj, rv.dtype, so, float(eps), float(scale), cfg):
            continue
        with gm.graph.inserting_before(node):
            a3 = gm.graph.call_function(torch.ops.aten.reshape.default, (a, [b, m, jj]))
            r3 = gm.graph.call_function(torch.ops.aten.reshape.default, (res, [b, m, kk]))
            new = gm.graph.call_function(
                torch.ops.spyre.proj_swiglu_mlp_norm_add.default,
                (a3, wo, r3, so, nw, eps, wg, wu, wd, scale),
            )
            flat = gm.graph.call_function(torch.ops.aten.reshape.default, (new, list(ov.shape)))
        a3.meta["val"] = av.reshape(b, m, jj)
        r3.meta["val"] = rv.reshape(b, m, kk)
        val = torch.ops.spyre.proj_swiglu_mlp_norm_add.default(
            a3.meta["val"], wv, r3.meta["val"], so, _val(nw), eps,
            _val(wg), _val(wu), _val(wd), scale,
        )  # fmt: skip
        new.meta["val"] = val
        flat.meta["val"] = val.reshape(ov.shape)
        node.replace_all_uses_with(flat)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed
