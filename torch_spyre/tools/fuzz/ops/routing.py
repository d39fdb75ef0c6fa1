"""What decoders and mixtures of experts do beyond the element-wise grammar:
``select`` (top-k and sort: a router's choice), ``attention`` (scaled dot
product attention, grouped heads, causal or with an additive mask) and
``write`` (``index_copy`` / ``index_put``: a KV cache's row write) and
``route`` (gathers and scatters at the positions a top-k or sort computed: a
router dispatching tokens to experts and combining their outputs).

Left out of the CI seed set's config (``generator.CI``), which keeps the
graphs of its seeds as they were; ``--config long`` and ``--config routing``
draw them.
"""

from __future__ import annotations

import math

from torch_spyre.tools.fuzz.graph import Invalid, Node
from torch_spyre.tools.fuzz.ops.base import _norm_dim, _same_float, op
from torch_spyre.tools.fuzz.ops.indexing import _code_index


def _plain_input(n) -> bool:
    """A float32 graph input, not expanded: its values are made distinct
    (``distinct``) so that an index the selection returns is the same on
    every device (fp16 inputs of a hundred elements tie, and an expanded
    input repeats its values)."""
    return (
        n.op == "input"
        and n.attrs["kind"] == "float"
        and n.dtype == "float32"
        and n.attrs.get("layout") != "expanded"
    )


# ------------------------------------------------------------------ select
def _sample_select(b):
    kind = b.rng.choice(["topk", "topk", "sort", "topk_indices", "argsort"])
    x = b.pick(_plain_input) if kind in ("topk_indices", "argsort") else b.pick_float()
    if x is None:
        return None
    xn = b.g.nodes[x]
    if kind in ("topk_indices", "argsort"):
        xn.attrs["distinct"] = True  # its indices do not depend on ties
    rank = len(xn.shape)
    if rank == 0:
        return None
    d = b.rng.randrange(rank) - (rank if b.rng.random() < 0.5 else 0)
    size = xn.shape[d]
    k = b.rng.choice([1, 2, min(size, 8), size]) if kind.startswith("topk") else size
    return "select", (x,), {"kind": kind, "dim": d, "k": k, "largest": b.rng.random() < 0.8}


def _code_select(g, n, a):
    at = n.attrs
    d, k, big = at["dim"], at["k"], at["largest"]
    if at["kind"] == "topk":
        return f"torch.topk({a[0]}, {k}, dim={d}, largest={big}).values"
    if at["kind"] == "topk_indices":
        return f"torch.topk({a[0]}, {k}, dim={d}, largest={big}).indices"
    if at["kind"] == "sort":
        return f"torch.sort({a[0]}, dim={d}, descending={big}).values"
    return f"torch.argsort({a[0]}, dim={d}, descending={big})"


@op("select", 3, _sample_select, _code_select)
def _infer_select(g, n):
    x = _same_float(g, n)
    at = n.attrs
    d = _norm_dim(at["dim"], len(x.shape))
    if not 1 <= at["k"] <= x.shape[d]:
        raise Invalid("top-k larger than its dim")
    shape = list(x.shape)
    shape[d] = at["k"]
    n.shape = tuple(shape)
    if at["kind"] in ("topk_indices", "argsort"):
        if not _plain_input(x):
            raise Invalid("indices of a selection need distinct input values")
        n.dtype, n.lo, n.hi = "int64", 0.0, float(x.shape[d] - 1)
    else:
        n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi


# --------------------------------------------------------------- attention
#: |q| and |k| at most this: scores stay within fp16 and far from exp's overflow
_QK_BOUND = 4.0


def _sample_attention(b):
    q = b.pick_float(lambda n: len(n.shape) in (3, 4) and n.bound <= _QK_BOUND)
    if q is None:
        return None
    qn = b.g.nodes[q]
    rank = len(qn.shape)
    heads = qn.shape[-3]
    # grouped heads: K and V carry a divisor of the query heads
    kv_heads = b.rng.choice([h for h in range(1, heads + 1) if heads % h == 0])
    s = b.rng.choice([[q, -2], b.size()])
    lead = [[q, 0]] if rank == 4 else []
    dt = qn.dtype
    k = b.new_float([*lead, kv_heads, s, [q, -1]], -2.0, 2.0, dtype=dt)
    v = b.new_float([*lead, kv_heads, [k, -2], b.size()], -2.0, 2.0, dtype=dt)
    args = [q, k, v]
    mode = b.rng.choice(["none", "causal", "mask"])
    if mode == "mask":
        args.append(b.new_float([[q, -2], [k, -2]], -4.0, 0.0, dtype=dt, layout_ok=False))
    scale = b.rng.choice([None, None, 0.5])
    return "attention", tuple(args), {"mode": mode, "scale": scale, "gqa": kv_heads != heads}


def _code_attention(g, n, a):
    at = n.attrs
    kw = []
    if at["mode"] == "mask":
        kw.append(f"attn_mask={a[3]}")
    if at["mode"] == "causal":
        kw.append("is_causal=True")
    if at["scale"] is not None:
        kw.append(f"scale={at['scale']}")
    if at["gqa"]:
        kw.append("enable_gqa=True")
    return f"F.scaled_dot_product_attention({', '.join([*a[:3], *kw])})"


@op("attention", 3, _sample_attention, _code_attention)
def _infer_attention(g, n):
    q, k, v = (g.nodes[i] for i in n.args[:3])
    if not all(t.is_float and t.dtype == q.dtype for t in (k, v)):
        raise Invalid("attention operands of one float dtype")
    rank = len(q.shape)
    if rank not in (3, 4) or len(k.shape) != rank or len(v.shape) != rank:
        raise Invalid("attention ranks")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise Invalid("attention batch")
    h, hk = q.shape[-3], k.shape[-3]
    if v.shape[-3] != hk or h % hk or (hk != h) != n.attrs["gqa"]:
        raise Invalid("attention heads")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise Invalid("attention dims")
    if max(q.bound, k.bound) > _QK_BOUND:
        raise Invalid("attention scores out of range")
    L, S = q.shape[-2], k.shape[-2]
    if n.attrs["mode"] == "mask":
        m = g.nodes[n.args[3]]
        if m.shape != (L, S) or m.dtype != q.dtype:
            raise Invalid("attention mask")
    n.shape = (*q.shape[:-1], v.shape[-1])
    n.dtype = q.dtype
    n.lo, n.hi = v.lo, v.hi  # each row a convex combination of V's rows
    n.acc = q.shape[-1] + S


# ------------------------------------------------------------------- write
def _sample_write(b):
    x = b.pick_float(lambda n: len(n.shape) >= 1)
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    kind = b.rng.choice(["index_copy", "index_put", "index_put_acc"])
    d = b.rng.randrange(rank) if kind == "index_copy" else 0
    n_rows = b.rng.randint(1, max(1, min(xn.shape[d], 8)))
    unique = None if kind == "index_put_acc" else 0
    idx = b.new_index([n_rows], [x, d], unique=unique)
    src = b.new_float(
        [[x, i] if i != d else [idx, 0] for i in range(rank)], -2.0, 2.0, dtype=xn.dtype
    )
    return "write", (x, idx, src), {"kind": kind, "dim": d}


def _code_write(g, n, a):
    at = n.attrs
    if at["kind"] in ("index_copy", "index_copy_"):
        # index_copy_ writes its input in place (a KV cache's update: models
        # only, ``motifs.py``; every run writes the same rows, so a rerun on
        # the written input gives the same values)
        return f"{a[0]}.{at['kind']}({at['dim']}, {a[1]}, {a[2]})"
    acc = at["kind"] == "index_put_acc"
    return f"{a[0]}.index_put(({a[1]},), {a[2]}, accumulate={acc})"


@op("write", 3, _sample_write, _code_write)
def _infer_write(g, n):
    x, idx, src = (g.nodes[i] for i in n.args)
    at = n.attrs
    if not x.is_float or idx.dtype != "int64" or src.dtype != x.dtype:
        raise Invalid("write operand dtypes")
    d = at["dim"]
    if not 0 <= d < len(x.shape) or len(idx.shape) != 1 or idx.hi >= x.shape[d]:
        raise Invalid("write index")
    want = list(x.shape)
    want[d] = idx.shape[0]
    if list(src.shape) != want:
        raise Invalid("write source")
    acc = at["kind"] == "index_put_acc"
    if not acc and idx.attrs.get("unique") != 0:
        raise Invalid("a write needs distinct rows")
    n.shape, n.dtype = x.shape, x.dtype
    if acc:
        cnt = idx.shape[0]
        n.acc = cnt + 1
        n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
    else:
        n.lo, n.hi = min(x.lo, src.lo), max(x.hi, src.hi)
    if math.isnan(n.lo):
        raise Invalid("write range")


# ------------------------------------------------------------------- route
def _computed_index(n) -> bool:
    """An index a graph computes (a top-k's or a sort's positions, maybe
    flattened): what a router hands its experts' gathers and scatters."""
    return n.op in ("select", "view") and n.dtype == "int64"


def _sample_route(b):
    i = b.pick(_computed_index)
    if i is None or b.rng.random() < 0.5:
        # a router: the top-k (or ranking) of a fresh [tokens, experts] score
        scores = b.new_float([b.size(), b.rng.choice([2, 4, 8, 16, 60])], layout_ok=False)
        experts = b.g.nodes[scores].shape[-1]
        kind = b.rng.choice(["topk_indices", "topk_indices", "argsort"])
        k = b.rng.choice([1, 2, min(4, experts)]) if kind == "topk_indices" else experts
        attrs = {"kind": kind, "dim": -1, "k": k, "largest": True}
        flat = b.rng.random() < 0.5  # flattened, as a dispatch's 1-D token order
        i = b.g.add(Node("select", (scores,), attrs))
        if flat:
            i = b.g.add(Node("view", (i,), {"kind": "flatten", "dims": [0, 1]}))
    ishape = b.g.nodes[i].shape
    rank = len(ishape)
    high = int(b.g.nodes[i].hi) + 1 + b.rng.choice([0, 0, 3])
    kinds = ["gather", "scatter_add", "embedding"] + (
        ["index_select", "index_add"] if rank == 1 else []
    )
    kind = b.rng.choice(kinds)
    dt = b.rng.choice(["float32", "float32", "float16"])
    if kind == "embedding":
        w = b.new_float([high, b.size()], dtype=dt)
        return "route", (i, w), {"kind": kind, "dim": 0}
    d = b.rng.randrange(rank) if kind in ("gather", "scatter_add") else 0
    if kind in ("gather", "scatter_add"):
        shape = [[i, j] if j != d else high for j in range(rank)]
    else:
        shape = [high, *([b.size()] if b.rng.random() < 0.7 else [])]
    x = b.new_float(shape, dtype=dt)
    if kind in ("gather", "index_select"):
        return "route", (x, i), {"kind": kind, "dim": d}
    src_shape = (
        [[i, j] for j in range(rank)]
        if kind == "scatter_add"
        else [[i, 0], *([[x, 1]] if len(shape) > 1 else [])]
    )
    src = b.new_float(src_shape, dtype=dt)
    return "route", (x, i, src), {"kind": kind, "dim": d}


@op("route", 3, _sample_route, _code_index)
def _infer_route(g, n):
    k, d = n.attrs["kind"], n.attrs["dim"]
    if k == "embedding":
        i, x = (g.nodes[j] for j in n.args)
    else:
        x, i = g.nodes[n.args[0]], g.nodes[n.args[1]]
    if not x.is_float or i.dtype != "int64" or not 0 <= d < len(x.shape):
        raise Invalid("route operands")
    if i.hi >= x.shape[d]:
        raise Invalid("route index out of range")
    n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi
    if k == "embedding":
        if len(x.shape) != 2:
            raise Invalid("embedding weight")
        n.shape = (*i.shape, x.shape[1])
    elif k == "gather":
        if len(i.shape) != len(x.shape) or any(
            a > c for j, (a, c) in enumerate(zip(i.shape, x.shape)) if j != d
        ):
            raise Invalid("gather index shape")
        n.shape = i.shape
    elif k == "index_select":
        if len(i.shape) != 1:
            raise Invalid("index_select index rank")
        s = list(x.shape)
        s[d] = i.shape[0]
        n.shape = tuple(s)
    else:
        src = g.nodes[n.args[2]]
        if src.dtype != x.dtype:
            raise Invalid("route source dtype")
        if k == "scatter_add":
            if (
                src.shape != i.shape
                or len(i.shape) != len(x.shape)
                or any(a > c for j, (a, c) in enumerate(zip(i.shape, x.shape)) if j != d)
            ):
                raise Invalid("scatter_add shapes")
            cnt = i.shape[d]
        else:
            if len(i.shape) != 1:
                raise Invalid("index_add index rank")
            want = list(x.shape)
            want[d] = i.shape[0]
            if list(src.shape) != want:
                raise Invalid("index_add source")
            cnt = i.shape[0]
        n.acc = cnt + 1
        n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
        n.shape = x.shape
