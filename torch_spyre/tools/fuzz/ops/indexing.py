"""Gathers and scatters (``index``)."""

from __future__ import annotations

from torch_spyre.tools.fuzz.graph import Invalid
from torch_spyre.tools.fuzz.ops.base import op


def _sample_index(b):
    x = b.pick_float()
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    d = b.rng.randrange(rank)
    kind = b.rng.choice(
        ["gather", "index_select", "index", "embedding", "scatter_add", "scatter", "index_add"]
    )
    if kind == "embedding":
        if rank != 2:
            kind = "index_select"
        else:
            d = 0
    if kind == "index" and b.rng.random() < 0.5:
        d = 0
    if kind in ("gather", "scatter_add", "scatter"):
        # index of x's rank, within x's shape off `d`
        shape = [[x, i] if i != d else b.rng.randint(1, max(1, xn.shape[d])) for i in range(rank)]
        if kind == "gather":
            shape[d] = b.size()
        unique = d if kind == "scatter" else None
        idx = b.new_index(shape, [x, d], unique=unique)
        if kind == "gather":
            return "index", (x, idx), {"kind": kind, "dim": d}
        src = b.new_float([[idx, i] for i in range(rank)], dtype=xn.dtype)
        return "index", (x, idx, src), {"kind": kind, "dim": d}
    if kind == "index_add":
        k = b.rng.randint(1, 8)
        idx = b.new_index([k], [x, d])
        src = b.new_float([[x, i] if i != d else [idx, 0] for i in range(rank)], dtype=xn.dtype)
        return "index", (x, idx, src), {"kind": kind, "dim": d}
    ishape = [b.rng.randint(1, 9)]
    if kind in ("index", "embedding") and b.rng.random() < 0.3:
        ishape.append(b.rng.randint(1, 5))
    idx = b.new_index(ishape, [x, d])
    if kind == "embedding":
        return "index", (idx, x), {"kind": kind, "dim": 0}
    return "index", (x, idx), {"kind": kind, "dim": d}


def _code_index(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    d = at["dim"]
    if k == "gather":
        return f"torch.gather({a[0]}, {d}, {a[1]})"
    if k == "index_select":
        return f"torch.index_select({a[0]}, {d}, {a[1]})"
    if k == "index":
        return f"{a[0]}[{':, ' * d}{a[1]}]"
    if k == "embedding":
        return f"F.embedding({a[0]}, {a[1]})"
    if k == "scatter_add":
        return f"{a[0]}.scatter_add({d}, {a[1]}, {a[2]})"
    if k == "scatter":
        return f"{a[0]}.scatter({d}, {a[1]}, {a[2]})"
    return f"{a[0]}.index_add({d}, {a[1]}, {a[2]})"


@op("index", 5, _sample_index, _code_index)
def _infer_index(g, n):
    at, k = n.attrs, n.attrs["kind"]
    args = [g.nodes[i] for i in n.args]
    d = at["dim"]
    if k == "embedding":
        idx, w = args
        x = w
        if len(w.shape) != 2 or d != 0:
            raise Invalid("embedding weight")
    else:
        x, idx = args[0], args[1]
    if not x.is_float or idx.dtype != "int64":
        raise Invalid("index operand dtypes")
    if not 0 <= d < len(x.shape) or idx.hi >= x.shape[d]:
        raise Invalid("index out of range")
    s = list(x.shape)
    n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi
    if k in ("gather", "scatter_add", "scatter"):
        if len(idx.shape) != len(s):
            raise Invalid("gather index rank")
        if any(a > c for i, (a, c) in enumerate(zip(idx.shape, s)) if i != d or k != "gather"):
            raise Invalid("gather index shape")
        if k == "gather":
            n.shape = idx.shape
            return
        src = args[2]
        if src.shape != idx.shape or src.dtype != x.dtype:
            raise Invalid("scatter source")
        if k == "scatter":
            if idx.attrs.get("unique") != d:
                raise Invalid("scatter needs distinct indices")
            n.lo, n.hi = min(x.lo, src.lo), max(x.hi, src.hi)
        else:
            cnt = idx.shape[d]
            n.acc = cnt + 1
            n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
        n.shape = tuple(s)
        return
    if k == "index_add":
        src = args[2]
        if len(idx.shape) != 1:
            raise Invalid("index_add index rank")
        want = list(s)
        want[d] = idx.shape[0]
        if list(src.shape) != want or src.dtype != x.dtype:
            raise Invalid("index_add source")
        cnt = idx.shape[0]
        n.acc = cnt + 1
        n.lo, n.hi = x.lo + cnt * min(src.lo, 0), x.hi + cnt * max(src.hi, 0)
        n.shape = tuple(s)
        return
    if k == "index_select" and len(idx.shape) != 1:
        raise Invalid("index_select index rank")
    if k == "embedding":
        n.shape = (*idx.shape, s[1])
        return
    s[d : d + 1] = list(idx.shape)
    n.shape = tuple(s)
