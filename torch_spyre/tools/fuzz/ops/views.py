"""Views and data movement: ``view``, ``slice``, ``cat``, ``rotate_half``, ``pad``
and ``misc``."""

from __future__ import annotations

import math

from torch_spyre.tools.fuzz.graph import Invalid
from torch_spyre.tools.fuzz.ops.base import _norm_dim, _same_float, op


def _sample_view(b):
    x = b.pick()
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    rank = len(shape)
    kinds = ["unsqueeze", "permute", "transpose", "contiguous", "flip"]
    if rank >= 2:
        kinds += ["merge", "merge", "flatten", "movedim", "mT"]
    if any(s > 1 and _divisors(s) for s in shape):
        kinds += ["split", "split"]
    if 1 in shape:
        kinds += ["squeeze", "expand"]
    kind = b.rng.choice(kinds)
    a: dict = {"kind": kind}
    if kind == "unsqueeze":
        a["dim"] = b.rng.randint(0, rank)
    elif kind == "permute":
        p = list(range(rank))
        b.rng.shuffle(p)
        a["perm"] = p
    elif kind in ("transpose", "movedim"):
        if rank < 2:
            return None
        a["dims"] = b.rng.sample(range(rank), 2)
    elif kind == "flip":
        a["dims"] = [b.rng.randrange(rank)]
    elif kind == "merge":
        a["dim"] = b.rng.randrange(rank - 1)
    elif kind == "flatten":
        s = b.rng.randrange(rank - 1)
        a["dims"] = [s, b.rng.randint(s + 1, rank - 1)]
    elif kind == "split":
        d = b.rng.choice([i for i, s in enumerate(shape) if s > 1 and _divisors(s)])
        a["dim"], a["factor"] = d, b.rng.choice(_divisors(shape[d]))
    elif kind == "squeeze":
        a["dim"] = b.rng.choice([i for i, s in enumerate(shape) if s == 1])
    elif kind == "expand":
        a["dim"] = b.rng.choice([i for i, s in enumerate(shape) if s == 1])
        a["size"] = b.size()
    return "view", (x,), a


def _divisors(s: int) -> list[int]:
    return [f for f in range(2, s) if s % f == 0][:6]


def _code_view(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    if k == "unsqueeze":
        return f"{a[0]}.unsqueeze({at['dim']})"
    if k == "squeeze":
        return f"{a[0]}.squeeze({at['dim']})"
    if k == "permute":
        return f"{a[0]}.permute({', '.join(map(str, at['perm']))})"
    if k == "transpose":
        return f"{a[0]}.transpose({at['dims'][0]}, {at['dims'][1]})"
    if k == "movedim":
        return f"{a[0]}.movedim({at['dims'][0]}, {at['dims'][1]})"
    if k == "mT":
        return f"{a[0]}.mT"
    if k == "contiguous":
        return f"{a[0]}.contiguous()"
    if k == "flip":
        return f"{a[0]}.flip({at['dims']})"
    if k == "flatten":
        return f"{a[0]}.flatten({at['dims'][0]}, {at['dims'][1]})"
    if k == "expand":
        return f"{a[0]}.expand({', '.join(map(str, n.shape))})"
    return f"{a[0]}.reshape({', '.join(map(str, n.shape))})"


@op("view", 10, _sample_view, _code_view)
def _infer_view(g, n):
    x = g.nodes[n.args[0]]
    s = list(x.shape)
    rank = len(s)
    at, k = n.attrs, n.attrs["kind"]
    if k == "unsqueeze":
        if not 0 <= at["dim"] <= rank:
            raise Invalid("unsqueeze dim")
        s.insert(at["dim"], 1)
    elif k == "squeeze":
        d = _norm_dim(at["dim"], rank)
        if s[d] != 1:
            raise Invalid("squeeze of a dim > 1")
        s.pop(d)
    elif k == "permute":
        if sorted(at["perm"]) != list(range(rank)):
            raise Invalid("permutation")
        s = [s[i] for i in at["perm"]]
    elif k in ("transpose", "movedim"):
        i, j = (_norm_dim(d, rank) for d in at["dims"])
        if k == "transpose":
            s[i], s[j] = s[j], s[i]
        else:
            s.insert(j, s.pop(i))
    elif k == "mT":
        if rank < 2:
            raise Invalid("mT of rank < 2")
        s[-1], s[-2] = s[-2], s[-1]
    elif k == "flip":
        for d in at["dims"]:
            _norm_dim(d, rank)
    elif k == "merge":
        d = at["dim"]
        if not 0 <= d < rank - 1:
            raise Invalid("merge dim")
        s[d : d + 2] = [s[d] * s[d + 1]]
    elif k == "flatten":
        a0, a1 = at["dims"]
        if not 0 <= a0 < a1 < rank:
            raise Invalid("flatten dims")
        s[a0 : a1 + 1] = [math.prod(s[a0 : a1 + 1])]
    elif k == "split":
        d, f = _norm_dim(at["dim"], rank), at["factor"]
        if s[d] % f:
            raise Invalid("split of an indivisible dim")
        s[d : d + 1] = [f, s[d] // f]
    elif k == "expand":
        d = _norm_dim(at["dim"], rank)
        if s[d] != 1:
            raise Invalid("expand of a dim > 1")
        s[d] = at["size"]
    elif k != "contiguous":
        raise Invalid(k)
    if len(s) > 5 or len(s) < 1:
        raise Invalid("rank")
    n.shape, n.dtype, n.lo, n.hi = tuple(s), x.dtype, x.lo, x.hi


def _sample_slice(b):
    x = b.pick(lambda n: max(n.shape) > 1)
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    d = b.rng.choice([i for i, s in enumerate(shape) if s > 1])
    size = shape[d]
    kind = b.rng.choice(["slice", "slice", "select", "chunk", "narrow_end"])
    if kind == "select":
        return "slice", (x,), {"kind": kind, "dim": d, "index": b.rng.randrange(size)}
    if kind == "chunk":
        c = b.rng.randint(2, min(size, 4))
        return "slice", (x,), {"kind": kind, "dim": d, "chunks": c, "index": b.rng.randrange(c)}
    start = b.rng.randrange(size)
    stop = b.rng.randint(start + 1, size)
    step = b.rng.choice([1, 1, 1, 2, 3])
    if kind == "narrow_end":  # x[..., :-k] / x[..., k:]
        return "slice", (x,), {"kind": "slice", "dim": d, "start": start, "stop": None, "step": 1}
    return "slice", (x,), {"kind": kind, "dim": d, "start": start, "stop": stop, "step": step}


def _code_slice(g, n, a):
    at = n.attrs
    pre = ":, " * at["dim"]
    if at["kind"] == "select":
        return f"{a[0]}[{pre}{at['index']}]"
    if at["kind"] == "chunk":
        return f"{a[0]}.chunk({at['chunks']}, {at['dim']})[{at['index']}]"
    stop = "" if at["stop"] is None else at["stop"]
    step = "" if at["step"] == 1 else f":{at['step']}"
    return f"{a[0]}[{pre}{at['start']}:{stop}{step}]"


@op("slice", 6, _sample_slice, _code_slice)
def _infer_slice(g, n):
    x = g.nodes[n.args[0]]
    at = n.attrs
    s = list(x.shape)
    d = at["dim"]
    if not 0 <= d < len(s):
        raise Invalid("slice dim")
    if at["kind"] == "select":
        if not 0 <= at["index"] < s[d]:
            raise Invalid("select index")
        s.pop(d)
        if not s:
            raise Invalid("select to a scalar")
    elif at["kind"] == "chunk":
        c = at["chunks"]
        per = -(-s[d] // c)
        lens = [min(per, s[d] - per * i) for i in range(c)]
        if at["index"] >= len(lens) or lens[at["index"]] < 1:
            raise Invalid("chunk index")
        s[d] = lens[at["index"]]
    else:
        stop = s[d] if at["stop"] is None else at["stop"]
        if not 0 <= at["start"] < stop <= s[d]:
            raise Invalid("slice bounds")
        s[d] = len(range(at["start"], stop, at["step"]))
    n.shape, n.dtype, n.lo, n.hi = tuple(s), x.dtype, x.lo, x.hi


def _sample_cat(b):
    x = b.pick()
    if x is None:
        return None
    xn = b.g.nodes[x]
    rank = len(xn.shape)
    d = b.rng.randrange(rank)
    stack = b.rng.random() < 0.2
    k = b.rng.choice([2, 2, 3])
    args = [x]
    for _ in range(k - 1):

        def fits(n, xn=xn, d=d, stack=stack):
            if n.dtype != xn.dtype or len(n.shape) != len(xn.shape):
                return False
            return all(a == c for i, (a, c) in enumerate(zip(n.shape, xn.shape)) if stack or i != d)

        y = b.pick(fits, exclude=x)
        if y is None or b.rng.random() < 0.5:
            if not xn.is_float:
                return None
            shape = [[x, i] for i in range(rank)]
            if not stack:
                shape[d] = b.size()
            y = b.new_float(shape, dtype=xn.dtype)
        args.append(y)
    b.rng.shuffle(args)
    if stack:
        d = b.rng.randint(0, rank)
    return "cat", tuple(args), {"dim": d, "stack": stack}


def _code_cat(g, n, a):
    f = "stack" if n.attrs["stack"] else "cat"
    return f"torch.{f}([{', '.join(a)}], dim={n.attrs['dim']})"


@op("cat", 5, _sample_cat, _code_cat)
def _infer_cat(g, n):
    xs = [g.nodes[i] for i in n.args]
    x0 = xs[0]
    d = n.attrs["dim"]
    rank = len(x0.shape)
    for x in xs[1:]:
        if x.dtype != x0.dtype or len(x.shape) != rank:
            raise Invalid("cat operands")
    if n.attrs["stack"]:
        if not 0 <= d <= rank or any(x.shape != x0.shape for x in xs):
            raise Invalid("stack")
        s = list(x0.shape)
        s.insert(d, len(xs))
    else:
        if not 0 <= d < rank:
            raise Invalid("cat dim")
        for x in xs[1:]:
            if any(a != c for i, (a, c) in enumerate(zip(x.shape, x0.shape)) if i != d):
                raise Invalid("cat shapes")
        s = list(x0.shape)
        s[d] = sum(x.shape[d] for x in xs)
    n.shape, n.dtype = tuple(s), x0.dtype
    n.lo, n.hi = min(x.lo for x in xs), max(x.hi for x in xs)


def _sample_rotate(b):
    x = b.pick_float(lambda n: n.shape[-1] % 2 == 0)
    if x is None:
        return None
    return "rotate_half", (x,), {}


@op(
    "rotate_half",
    1.5,
    _sample_rotate,
    lambda g, n, a: (
        f"torch.cat((-{a[0]}[..., {g.nodes[n.args[0]].shape[-1] // 2}:], "
        f"{a[0]}[..., :{g.nodes[n.args[0]].shape[-1] // 2}]), dim=-1)"
    ),
)
def _infer_rotate(g, n):
    x = _same_float(g, n)
    if x.shape[-1] % 2:
        raise Invalid("rotate_half of an odd dim")
    n.shape, n.dtype = x.shape, x.dtype
    n.lo, n.hi = -x.bound, x.bound


def _sample_pad(b):
    x = b.pick_float()
    if x is None:
        return None
    rank = len(b.g.nodes[x].shape)
    mode = b.rng.choice(["constant", "constant", "constant", "reflect", "replicate"])
    k = 1 if rank < 3 or b.rng.random() < 0.6 else 2
    if mode != "constant" and rank < 2:
        mode = "constant"
    pads = [b.rng.randint(0, 3) for _ in range(2 * k)]
    if not any(pads):
        pads[0] = 1
    return "pad", (x,), {"mode": mode, "pads": pads, "value": b.rng.choice([0.0, 0.5])}


def _code_pad(g, n, a):
    at = n.attrs
    if at["mode"] == "constant":
        return f"F.pad({a[0]}, {at['pads']}, value={at['value']!r})"
    return f"F.pad({a[0]}, {at['pads']}, mode={at['mode']!r})"


@op("pad", 3, _sample_pad, _code_pad)
def _infer_pad(g, n):
    x = _same_float(g, n)
    at = n.attrs
    pads = at["pads"]
    k = len(pads) // 2
    s = list(x.shape)
    if k > len(s) or any(p < 0 for p in pads):
        raise Invalid("pad")
    for i in range(k):
        d = len(s) - 1 - i
        if at["mode"] == "reflect" and max(pads[2 * i], pads[2 * i + 1]) >= s[d]:
            raise Invalid("reflect pad wider than the dim")
        s[d] += pads[2 * i] + pads[2 * i + 1]
    if at["mode"] != "constant" and not (len(s) - k in (1, 2) and len(s) >= 2):
        raise Invalid("non-constant pad rank")
    n.shape, n.dtype = tuple(s), x.dtype
    v = at["value"] if at["mode"] == "constant" else x.lo
    n.lo, n.hi = min(x.lo, v), max(x.hi, v)


def _sample_misc(b):
    x = b.pick()
    if x is None:
        return None
    shape = b.g.nodes[x].shape
    rank = len(shape)
    kind = b.rng.choice(["roll", "repeat", "repeat_interleave", "tril", "triu", "cumsum", "cumsum"])
    if kind in ("tril", "triu") and rank < 2:
        kind = "roll"
    if kind == "cumsum" and not b.g.nodes[x].is_float:
        kind = "roll"
    a = {"kind": kind, "dim": b.rng.randrange(rank)}
    if kind == "roll":
        a["shift"] = b.rng.choice([1, -1, 2, 5])
    elif kind == "repeat":
        a["reps"] = [b.rng.choice([1, 1, 2, 3]) for _ in range(rank)]
    elif kind == "repeat_interleave":
        a["reps"] = b.rng.choice([2, 3])
    elif kind in ("tril", "triu"):
        a["diag"] = b.rng.choice([0, 0, 1, -1])
    return "misc", (x,), a


def _code_misc(g, n, a):
    at, k = n.attrs, n.attrs["kind"]
    if k == "roll":
        return f"torch.roll({a[0]}, {at['shift']}, {at['dim']})"
    if k == "repeat":
        return f"{a[0]}.repeat({', '.join(map(str, at['reps']))})"
    if k == "repeat_interleave":
        return f"{a[0]}.repeat_interleave({at['reps']}, dim={at['dim']})"
    if k in ("tril", "triu"):
        return f"torch.{k}({a[0]}, {at['diag']})"
    return f"torch.cumsum({a[0]}, dim={at['dim']})"


@op("misc", 4, _sample_misc, _code_misc)
def _infer_misc(g, n):
    x = g.nodes[n.args[0]]
    at, k = n.attrs, n.attrs["kind"]
    s = list(x.shape)
    d = at["dim"]
    if not 0 <= d < len(s):
        raise Invalid("dim")
    n.dtype, n.lo, n.hi = x.dtype, x.lo, x.hi
    if k == "repeat":
        if len(at["reps"]) != len(s):
            raise Invalid("repeat rank")
        s = [a * r for a, r in zip(s, at["reps"])]
    elif k == "repeat_interleave":
        s[d] *= at["reps"]
    elif k in ("tril", "triu"):
        if len(s) < 2:
            raise Invalid("tril of rank < 2")
        n.lo, n.hi = min(x.lo, 0.0), max(x.hi, 0.0)
    elif k == "cumsum":
        if not x.is_float:
            raise Invalid("cumsum of non-float")
        n.acc = s[d]
        n.lo, n.hi = min(x.lo * s[d], x.lo), max(x.hi * s[d], x.hi)
    n.shape = tuple(s)
