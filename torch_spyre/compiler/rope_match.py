"""Matchers for an attention projection's head split and its rotary
embedding in post-grad FX graphs (``projection_fusion.py`` folds both into
the projections program).

transformers' attention takes ``q = q_proj(h).view(b, s, -1, d).transpose(1,
2)`` and ``apply_rotary_pos_emb``'s ``q * cos.unsqueeze(1) + rotate_half(q) *
sin.unsqueeze(1)``; vLLM's (our ``SpyreRotary``) keeps the tokens outermost,
``q.view(t, -1, d) * cos[:, None] + rotate_half(...) * sin[:, None]`` with
the tables gathered by position.  By the time these run, the spyre graph pass has made
``rotate_half`` a matmul by a signed permutation table (``passes.
_rewrite_lane_shuffles``: the rows of ``q`` in memory order, ``@ P``, viewed
and permuted back like ``q``), so that is the form matched, with the table
checked to be ``rotate_half``'s."""

from __future__ import annotations

import operator

import torch

from torch_spyre.compiler.fx_match import VIEWS
from torch_spyre.compiler.fx_match import is_op as _is

_SWAP = [0, 2, 1, 3]
#: a clone's memory formats that give rows in order
_ROWS = (None, torch.contiguous_format, torch.preserve_format)


def _sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _shape(node) -> tuple[int, ...] | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def head_split(mm: torch.fx.Node, b: int, s: int):
    """(``t``, head size, head norm) when the projection ``mm`` [b * s, N] is
    read only as ``t = mm.view(b, s, N / d, d).transpose(1, 2)`` (through views
    that each feed only the next), or as ``t = norm(mm.view(b, s, N / d,
    d)).transpose(1, 2)`` with ``norm`` an RMS norm over each head (Qwen3's
    ``q_norm``; head norm = (weight, eps), its nodes read by nothing else);
    else None."""
    node = mm
    user = _sole_user(node)
    while user is not None and _is(user, *VIEWS) and user.args[0] is node:
        node, user = user, _sole_user(user)
    shape = _shape(node)
    if node is mm or shape is None or len(shape) != 4 or shape[:2] != (b, s):
        return None
    norm = None
    if not _is(user, "permute"):  # a norm's first nodes (an fp32 one reads x twice)
        found = _head_norm(node)
        if found is None:
            return None
        user, norm = found
    if _is(user, "permute") and list(user.args[1]) == _SWAP:
        return user, int(shape[3]), norm
    return None


def token_heads(piece: torch.fx.Node, rows: int) -> tuple[torch.fx.Node, int] | None:
    """(``t``, head size) when the projection ``piece`` [rows, N] is read only
    as ``t = piece.view(rows, N / d, d)`` (through views that each feed only
    the next): vLLM's token-major heads; else None."""
    node, found = piece, None
    user = _sole_user(node)
    while user is not None and _is(user, *VIEWS) and user.args[0] is node:
        node, user = user, _sole_user(user)
        shape = _shape(node)
        if shape is not None and len(shape) == 3 and shape[0] == rows:
            found = node, int(shape[2])
    return found


def _head_norm(x: torch.fx.Node):
    """(the transpose after it, (weight, eps)) when ``x`` [b, s, h, d] is read
    only by an RMS norm over its last dim (``norm_match.rms_norm_of``) whose
    output is read only by a transpose; else None."""
    from torch_spyre.compiler.norm_match import rms_norm_of

    todo, near = list(x.users), []
    while todo and len(near) < 16:  # the norm is 8 nodes (9 with a cast)
        n = todo.pop()
        if n not in near:
            near.append(n)
            todo += list(n.users)
    for out in near:
        seen: list = []
        found = rms_norm_of(out, seen)
        if found is None or found[0] is not x:
            continue
        inner = set(seen) - {out}
        if any(u not in inner and u is not out for n in inner for u in n.users):
            return None
        if any(u not in inner for u in x.users):
            return None
        perm = _sole_user(out)
        return (perm, (found[1], found[2])) if perm is not None else None
    return None


def _keeps_strides(u: torch.fx.Node) -> bool:
    """Whether ``u``'s output strides may follow its input's: a view (an op
    whose schema returns an alias of an input: split, slice, unsqueeze,
    reshape, ...; an item of a split's tuple), or a pointwise op (its output
    takes its inputs' memory format)."""
    if u.op != "call_function":
        return False
    if u.target is operator.getitem:
        return True
    schema = getattr(u.target, "_schema", None)
    if schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    ):
        return True
    return torch.Tag.pointwise in getattr(u.target, "tags", ())


def layout_free(t: torch.fx.Node) -> bool:
    """Whether every reader of ``t`` takes it by value, so it may be given
    contiguous: through its views and the pointwise ops whose strides follow
    it, no ``view`` whose validity depends on those strides
    (``passes._rows_matmul`` views the rows of a transposed tensor in its
    memory order; the lane steps of an interleaved rotary view a negated
    slice) and no ``as_strided``; not returned either (a graph output keeps
    the strides eager gives it: a copy)."""
    todo, seen = [t], {t}
    while todo:
        node = todo.pop()
        for u in node.users:
            if u.op == "output" or _is(u, "view", "_unsafe_view", "as_strided"):
                return False
            if u not in seen and _keeps_strides(u):
                seen.add(u)
                todo.append(u)
    return True


def _is_rotate_half_table(gm: torch.fx.GraphModule, table: torch.fx.Node, d: int) -> bool:
    """Whether the get_attr ``table`` is [d, d] with ``x @ table == rotate_half(x)``."""
    if table.op != "get_attr":
        return False
    try:
        t = gm.get_buffer(table.target)
    except AttributeError:
        return False
    if tuple(t.shape) != (d, d) or d % 2:
        return False
    eye = torch.eye(d, dtype=t.dtype)  # rotate_half(x) = x @ rotate_half(I)
    return bool(torch.equal(t.cpu(), torch.cat((-eye[:, d // 2 :], eye[:, : d // 2]), 1)))


def _table_of(mul: torch.fx.Node, x: torch.fx.Node) -> torch.fx.Node | None:
    """The other factor of ``mul`` = ``x * c`` (either order) when it is
    ``c = unsqueeze(table, 1)``: the table, else None."""
    if not _is(mul, "mul") or len(mul.args) != 2 or mul.kwargs:
        return None
    a, c = mul.args
    if a is not x:
        a, c = c, a
    if a is not x or not _is(c, "unsqueeze") or c.args[1] != 1:
        return None
    return c.args[0]


def rope_of(
    gm: torch.fx.GraphModule, t: torch.fx.Node, d: int, token_major: bool = False
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(``out``, cos, sin) when the head-split ``t`` [b, h, s, d] is read only
    as ``out = t * cos.unsqueeze(1) + rotate_half(t) * sin.unsqueeze(1)``,
    each node between feeding only the next; else None.  ``token_major``:
    ``t`` is [rows, h, d] and the tables [rows, d] (vLLM's rotary over
    position-gathered rows, ``vllm_plugin/layers.SpyreRotary``)."""
    if len(t.users) != 2:
        return None
    by_cos = next((u for u in t.users if _is(u, "mul")), None)
    rot = next((u for u in t.users if u is not by_cos), None)
    if by_cos is None or rot is None:
        return None
    cos = _table_of(by_cos, t)
    # the rotation: t's rows in memory order (permuted back unless t is
    # contiguous: one head), @ P, viewed and permuted like t
    permuted = _is(rot, "permute")
    if permuted:
        if list(rot.args[1]) != _SWAP:
            return None
        rot = _sole_user(rot)
    elif token_major and _is(rot, "clone") and rot.kwargs.get("memory_format") in _ROWS:
        # a strided t (a slice of a merged projection) is copied to rows
        # first; the program's output is contiguous, so the copy is moot
        rot = _sole_user(rot)
    mm = _sole_user(rot) if rot is not None and _is(rot, *VIEWS) else None
    if mm is None or not _is(mm, "mm") or mm.args[0] is not rot:
        return None
    if not _is_rotate_half_table(gm, mm.args[1], d):
        return None
    view = _sole_user(mm)
    last = _sole_user(view) if permuted and view is not None else view
    if last is None or (view is not None and not _is(view, *VIEWS)):
        return None
    if permuted and (not _is(last, "permute") or list(last.args[1]) != _SWAP):
        return None
    if _shape(last) != _shape(t):
        return None
    by_sin = _sole_user(last)
    sin = _table_of(by_sin, last) if by_sin is not None else None
    out = _sole_user(by_sin) if by_sin is not None else None
    if cos is None or sin is None or out is None or _sole_user(by_cos) is not out:
        return None
    if not _is(out, "add") or set(out.args) != {by_cos, by_sin} or out.kwargs:
        return None
    if token_major:
        ok = ((_shape(t)[0], d),)
    else:
        b, s = _shape(t)[0], _shape(t)[2]
        ok = ((1, s, d), (b, s, d))
    for table in (cos, sin):
        if _shape(table) not in ok:
            return None
    if _shape(cos) != _shape(sin):
        return None
    return out, cos, sin
