"""Model-shaped motifs: an attention half and an MLP half of a decoder layer,
written in the grammar's own ops, with random variations.

The op grammar alone rarely writes what the compiler's fused programs match
(an RMS norm read only by two or more 16-bit projections, each split into
heads, rotated by one pair of tables and written into a KV cache; a gated
MLP and its residual): each takes several ops in one order and sizes the
card's sticks allow.  A motif plays such a sequence with its sizes, dtypes
and options drawn at random — and its near misses, where a matcher must let
go: a bias, a head size no stick divides, a layer norm, two rotary tables,
an activation that is not SiLU, a norm in the input's dtype, a projection
read twice (the generator's random ops after the motif add more of those:
they read the motif's nodes as operands).  Every node is an ordinary
grammar node, so the oracle measures its rounding and the minimiser cuts it
like any other.

Weights are drawn in ranges that keep each value's inferred bound where the
next op accepts it (attention's ``|q|, |k| <= 4``), so most motifs type-check.
"""

from __future__ import annotations

import math

from torch_spyre.tools.fuzz.graph import Invalid, Node

#: a projection's output bound (before a rotation doubles it): attention
#: takes |q| and |k| up to 4 (``ops/routing._QK_BOUND``)
_QK_OUT = 1.8


def _add(b, op: str, args, attrs: dict | None = None) -> int:
    i = b.g.add(Node(op, tuple(args), dict(attrs or {})))
    if b.g.nodes[i].numel > b.config.max_numel:
        raise Invalid("motif node too large")
    return i


def _bound(b, i: int) -> float:
    return max(b.g.nodes[i].bound, 1e-3)


def _linear(b, x: int, n: int, out_bound: float, bias: bool = False) -> int:
    """``F.linear(x, w[, bias])`` with ``w`` [n, k] drawn so that the output's
    inferred bound is about ``out_bound``."""
    xn = b.g.nodes[x]
    k = xn.shape[-1]
    wb = out_bound / (_bound(b, x) * k)
    w = b.new_float([n, [x, -1]], -wb, wb, dtype=xn.dtype, layout_ok=b.rng.random() < 0.2)
    args = [x, w]
    if bias:
        args.append(b.new_float([[w, 0]], -0.1 * out_bound, 0.1 * out_bound, dtype=xn.dtype))
    return _add(b, "matmul", args, {"kind": "linear"})


def _rms_norm(b, x: int, weight: tuple[float, float] = (0.5, 1.5)) -> int:
    """transformers' RMS norm of ``x`` over its last dim, or a variant.

    Mostly ``LlamaRMSNorm`` (16-bit input: up-cast, norm in fp32, cast back,
    times the weight), else ``F.rms_norm``, a norm computed in the input's
    16-bit dtype, or a layer norm (what the norm matchers must not take)."""
    xn = b.g.nodes[x]
    tail = [[x, -1]]
    kind = b.rng.choices(["llama", "rms", "manual16", "layer"], [12, 1, 1, 1])[0]
    if kind == "llama" or (kind == "manual16" and xn.dtype == "float32"):
        h = _add(b, "cast", [x], {"to": "float32"}) if xn.dtype != "float32" else x
        h = _add(b, "norm", [h], {"kind": "rms_manual", "k": 1})
        if xn.dtype != "float32":
            h = _add(b, "cast", [h], {"to": xn.dtype})
        w = b.new_float(tail, *weight, dtype=xn.dtype)
        return _add(b, "binary", [w, h] if b.rng.random() < 0.5 else [h, w], {"f": "mul"})
    w = b.new_float(tail, *weight, dtype=xn.dtype)
    if kind == "layer":
        return _add(b, "norm", [x, w], {"kind": "layer", "k": 1})
    return _add(b, "norm", [x, w], {"kind": "rms" if kind == "rms" else "rms_manual", "k": 1})


def _heads(b, p: int, heads: int) -> int:
    """``p`` [b, s, heads * d] viewed as [b, s, heads, d]."""
    return _add(b, "view", [p], {"kind": "split", "dim": 2, "factor": heads})


def _transpose(b, x: int) -> int:
    return _add(b, "view", [x], {"kind": "transpose", "dims": [1, 2]})


def _rotate(b, t: int, cos: int, sin: int) -> int:
    """transformers' RoPE: ``t * cos + rotate_half(t) * sin``."""
    a = _add(b, "binary", [t, cos], {"f": "mul"})
    r = _add(b, "rotate_half", [t])
    c = _add(b, "binary", [r, sin], {"f": "mul"})
    return _add(b, "binary", [a, c], {"f": "add"})


def _tables(b, x: int, d: int, dt: str) -> tuple[int, int]:
    """cos and sin [b, 1, s, d] (as ``cos.unsqueeze(1)`` gives them)."""
    shape = [[x, 0], [x, 1], d]
    cos = b.new_float(shape, -1.0, 1.0, dtype=dt, layout_ok=False)
    sin = b.new_float(shape, -1.0, 1.0, dtype=dt, layout_ok=False)
    return tuple(_add(b, "view", [t], {"kind": "unsqueeze", "dim": 1}) for t in (cos, sin))


def _head_geometry(rng) -> tuple[str, int, int, int]:
    """(dtype, head size, KV heads, query heads per KV head) of an attention
    half: head sizes whose halves are whole sticks, mostly, else a near miss."""
    dt = rng.choice(["float16", "float16", "float32"])
    stick = 64 if dt == "float16" else 32
    d = rng.choice([2 * stick] * 4 + [48])
    hk = rng.choice([1, 1, 2])
    g = rng.choice([1, 2, 2, 4])
    return dt, d, hk, g


def _slice(b, x: int, start: int, stop: int, dim: int = -1) -> int:
    """``x[..., start:stop]`` along ``dim`` (a merged projection's part, a
    cache's first rows)."""
    d = dim % len(b.g.nodes[x].shape)
    return _add(b, "slice", [x], {"kind": "slice", "dim": d, "start": start, "stop": stop,
                                  "step": 1})  # fmt: skip


def attention_half_vllm(b) -> int:
    """The same half as vLLM's models write it, token-major: the residual
    added before the norm (``RMSNorm(x, residual)``), one merged QKV
    projection sliced into Q, K and V, the rotation over [tokens, heads, d]
    with cos and sin rows gathered per token, the output projection and the
    residual.  (vLLM's attention op is opaque to the compiler; here SDPA
    over [heads, tokens, d] stands for it.)  Its last node."""
    rng = b.rng
    dt, d, hk, g = _head_geometry(rng)
    tokens = rng.choice([16, 32, 64, 64, 65, 128, 130])
    k = rng.choice([64, 96, 128])
    x = b.new_float([tokens, k], -2.0, 2.0, dtype=dt, layout_ok=rng.random() < 0.2)
    if rng.random() < 0.6:
        res = b.new_float([[x, 0], [x, 1]], -2.0, 2.0, dtype=dt, layout_ok=False)
        x = _add(b, "binary", [x, res], {"f": "add"})
    h = _rms_norm(b, x)
    hq = hk * g
    qkv = _linear(b, h, (hq + 2 * hk) * d, _QK_OUT, rng.random() < 0.07)
    q = _slice(b, qkv, 0, hq * d)
    kk = _slice(b, qkv, hq * d, (hq + hk) * d)
    v = _slice(b, qkv, (hq + hk) * d, (hq + 2 * hk) * d)
    split = {"kind": "split", "dim": 1}
    q = _add(b, "view", [q], {**split, "factor": hq})
    kk = _add(b, "view", [kk], {**split, "factor": hk})
    v = _add(b, "view", [v], {**split, "factor": hk})
    if rng.random() < 0.8:
        # rows [tokens, d] (gathered by position in vLLM), [:, None] per head
        cos, sin = (
            _add(b, "view", [b.new_float([[x, 0], d], -1.0, 1.0, dtype=dt, layout_ok=False)],
                 {"kind": "unsqueeze", "dim": 1})
            for _ in range(2)
        )  # fmt: skip
        q, kk = _rotate(b, q, cos, sin), _rotate(b, kk, cos, sin)
    swap = {"kind": "transpose", "dims": [0, 1]}
    q, kk, v = (_add(b, "view", [t], swap) for t in (q, kk, v))
    mode = rng.choice(["causal", "causal", "none"])
    o = _add(b, "attention", [q, kk, v], {"mode": mode, "scale": None, "gqa": g > 1})
    o = _add(b, "view", [_add(b, "view", [o], swap)], {"kind": "merge", "dim": 1})
    y = _linear(b, o, k, 2.0)
    return _add(b, "binary", [y, x], {"f": "add"}) if rng.random() < 0.8 else y


def mlp_half_vllm(b, x: int | None = None) -> int:
    """vLLM's MLP: the norm, one merged gate-and-up projection, SiluAndMul
    (``silu(gu[..., :n]) * gu[..., n:]``), the down projection and maybe
    the residual; token-major.  Its last node."""
    rng = b.rng
    if x is None or b.g.nodes[x].numel * 6 > b.config.max_numel:
        dt = rng.choice(["float16", "float16", "float32"])
        shape = [rng.choice([16, 64, 64, 65, 128]), rng.choice([64, 128])]
        x = b.new_float(shape, -2.0, 2.0, dtype=dt, layout_ok=rng.random() < 0.2)
    k = b.g.nodes[x].shape[-1]
    n = rng.choice([k, 2 * k])
    h = _rms_norm(b, x)
    gu = _linear(b, h, 2 * n, 4.0)
    act = _add(b, "unary", [_slice(b, gu, 0, n)], {"f": "silu"})
    act = _add(b, "binary", [act, _slice(b, gu, n, 2 * n)], {"f": "mul"})
    y = _linear(b, act, k, 2.0)
    return _add(b, "binary", [y, x], {"f": "add"}) if rng.random() < 0.8 else y


def attention_half(b) -> int:
    """An attention block's half: norm, Q/K/V projections split into heads,
    maybe per-head norms, RoPE and a KV-cache write, attention (causal, a
    mask or none; grouped heads), the output projection and maybe the
    residual.  Its last node."""
    rng = b.rng
    dt, d, hk, g = _head_geometry(rng)
    bsz = rng.choice([1, 1, 2])
    seq = rng.choice([32, 64, 64, 65, 96, 128])
    k = rng.choice([64, 96, 128])
    x = b.new_float([bsz, seq, k], -2.0, 2.0, dtype=dt, layout_ok=rng.random() < 0.2)
    h = _rms_norm(b, x)
    bias = rng.random() < 0.07
    q = _linear(b, h, hk * g * d, _QK_OUT, bias)
    kk = _linear(b, h, hk * d, _QK_OUT, bias)
    v = _linear(b, h, hk * d, 2.0, bias)
    if rng.random() < 0.1:  # a projection read twice (an extra reader)
        _add(b, "unary", [kk], {"f": "scale"})
    q, kk, v = _heads(b, q, hk * g), _heads(b, kk, hk), _heads(b, v, hk)
    if rng.random() < 0.25:  # Qwen3's q_norm / k_norm, over each head
        c = 1.5 / math.sqrt(d)  # the normed head's bound is sqrt(d)
        q, kk = _rms_norm(b, q, (0.3 * c, c)), _rms_norm(b, kk, (0.3 * c, c))
    q, kk, v = _transpose(b, q), _transpose(b, kk), _transpose(b, v)
    if rng.random() < 0.7:
        cos, sin = _tables(b, x, d, dt)
        if rng.random() < 0.07:  # K rotated by other tables
            kcos, ksin = _tables(b, x, d, dt)
        else:
            kcos, ksin = cos, sin
        q, kk = _rotate(b, q, cos, sin), _rotate(b, kk, kcos, ksin)
    mode = rng.choice(["causal", "causal", "none", "mask"])
    if rng.random() < 0.35:
        # a static cache: the new rows written at their positions (a prefill's
        # consecutive ones, or any), the attention over the whole cache
        length = seq + rng.choice([0, 7, 64])
        run = rng.random() < 0.6
        pos = b.new_positions([[x, 1]], length, run)
        write = "index_copy_" if rng.random() < 0.6 else "index_copy"
        caches = []
        for t in (kk, v):
            cache = b.new_float([[x, 0], hk, length, d], -2.0 if t == v else -_QK_OUT,
                                2.0 if t == v else _QK_OUT, dtype=dt, layout_ok=False)  # fmt: skip
            caches.append(_add(b, "write", [cache, pos, t], {"kind": write, "dim": 2}))
        kk, v = caches
        if mode == "causal":
            # causal over the cache's first rows, as transformers slices an
            # empty static cache for a prefill (read in place by the flash
            # program), or over all of it with a mask
            if rng.random() < 0.5:
                kk, v = (_slice(b, t, 0, seq, dim=2) for t in (kk, v))
            else:
                mode = "mask"
    args = [q, kk, v]
    if mode == "mask":
        args.append(b.new_float([[q, -2], [kk, -2]], -4.0, 0.0, dtype=dt, layout_ok=False))
    scale = rng.choice([None, None, 0.5])
    o = _add(b, "attention", args, {"mode": mode, "scale": scale, "gqa": g > 1})
    o = _transpose(b, o)
    o = _add(b, "view", [o], {"kind": "merge", "dim": 2})
    y = _linear(b, o, k, 2.0)
    if rng.random() < 0.7:
        y = _add(b, "binary", [y, x], {"f": "add"})
    return y


def mlp_half(b, x: int | None = None) -> int:
    """An MLP block's half: norm, gate and up projections, the activation
    (SiLU mostly), their product, the down projection and maybe the
    residual.  ``x``: the residual stream (a new input when None).  Its
    last node."""
    rng = b.rng
    if x is None or b.g.nodes[x].numel * 4 > b.config.max_numel:
        dt = rng.choice(["float16", "float16", "float32"])
        shape = [rng.choice([1, 2]), rng.choice([16, 64, 64, 65, 128]), rng.choice([64, 128])]
        x = b.new_float(shape, -2.0, 2.0, dtype=dt, layout_ok=rng.random() < 0.2)
    xn = b.g.nodes[x]
    k = xn.shape[-1]
    n = rng.choice([k, 2 * k, 3 * k])
    h = _rms_norm(b, x)
    gate = _linear(b, h, n, 4.0)
    act = _add(b, "unary", [gate], {"f": rng.choices(["silu", "gelu", "relu"], [6, 1, 1])[0]})
    if rng.random() < 0.85:
        up = _linear(b, h, n, 4.0)
        act = _add(b, "binary", [act, up] if rng.random() < 0.8 else [up, act], {"f": "mul"})
    y = _linear(b, act, k, 2.0)
    if rng.random() < 0.8:
        y = _add(b, "binary", [y, x] if rng.random() < 0.8 else [x, y], {"f": "add"})
    return y


def play(b) -> None:
    """One or two motifs into ``b``'s graph (an attention half, an MLP half,
    or the two in a row; as transformers or as vLLM writes them); a motif
    that does not type-check is left out."""
    choice = b.rng.choice(["attention", "mlp", "layer", "layer"])
    vllm = b.rng.random() < 0.35
    attn, mlp = (attention_half_vllm, mlp_half_vllm) if vllm else (attention_half, mlp_half)
    mark = len(b.g.nodes)
    try:
        if choice == "attention":
            attn(b)
        elif choice == "mlp":
            mlp(b)
        else:
            mlp(b, attn(b))
    except Invalid:
        del b.g.nodes[mark:]


__all__ = ["attention_half", "attention_half_vllm", "mlp_half", "mlp_half_vllm", "play"]
