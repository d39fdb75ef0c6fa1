"""Projections of one activation as one kernel program, optionally behind the
RMS norm that precedes them: an attention block's Q, K and V projections of
the normed residual stream read it once, and the normed rows never reach
device memory.

``spyre::norm_projections(x, nw, eps, ws)`` = ``[F.linear(h, w) for w in ws]``
with ``h = rms_norm(x, nw, eps)`` (``ops/mlp.rms_norm``; ``nw=None``: ``h =
x``), nn.Linear weights without biases.  It runs
``kernels.projections.best_norm_projections`` on the card; the spyre graph
pass routes a norm whose every user is such a projection here
(``compiler/projection_fusion.py``); the eager op is callable directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_spyre.ops.mlp import activation_rows, rms_norm
from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op(
    "spyre::norm_projections",
    mutates_args=(),
    # written out: infer_schema has no optional tensor list with a default
    schema="(Tensor x, Tensor? nw, float eps, Tensor[] ws, Tensor? cos=None, Tensor? sin=None, "
    "SymInt head_dim=0, bool[]? rope=None, bool[]? heads_first=None, Tensor[]? head_norms=None, "
    "bool[]? head_normed=None, float head_norm_eps=0.0) -> Tensor[]",
)
def norm_projections(
    x: torch.Tensor,
    nw: torch.Tensor | None,
    eps: float,
    ws: list[torch.Tensor],
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    head_dim: int = 0,
    rope: list[bool] | None = None,
    heads_first: list[bool] | None = None,
    head_norms: list[torch.Tensor] | None = None,
    head_normed: list[bool] | None = None,
    head_norm_eps: float = 0.0,
) -> list[torch.Tensor]:
    """``[x_normed @ w.T for w in ws]``, x [..., K], each w [N_i, K].

    With ``head_dim``, output ``i`` is attention heads: ``heads_first[i]``
    gives it as ``view(b, s, heads, head_dim).transpose(1, 2).contiguous()``
    (x [b, s, K]), and ``rope[i]`` rotates it as transformers'
    ``apply_rotary_pos_emb`` does with ``cos``, ``sin`` [1 or b, s,
    head_dim]: ``o * cos + rotate_half(o) * sin``.  ``head_normed[i]``:
    output ``i``'s heads are RMS-normed first (``rms_norm`` over each head,
    ``head_norm_eps``), as Qwen3's ``q_norm`` and ``k_norm`` do, with the
    next weight [head_dim] of ``head_norms``."""
    n = len(ws)
    rope = list(rope) if rope else [False] * n
    first = list(heads_first) if heads_first else [False] * n
    hn = _per_output(head_norms, head_normed, n)
    if (head_dim or any(rope) or any(first) or head_normed) and not _heads_args_ok(
        x, ws, cos, sin, head_dim, rope, first, hn
    ):
        raise ValueError(
            f"spyre::norm_projections: heads of {head_dim} need x [b, s, K], widths of whole "
            f"heads, one rope and layout flag per weight ({len(rope)}, {len(first)} for {n}), "
            "a head-norm weight [head_dim] for each normed output, and cos/sin [1 or b, s, "
            "head_dim] when any output is rotated"
        )
    if x.device.type == "spyre":
        out = _device_projections(
            x, nw, float(eps), ws, cos, sin, head_dim, rope, first, hn, float(head_norm_eps)
        )
        if out is not None:
            return out
    h = x if nw is None else rms_norm(x, nw, eps)
    outs = [F.linear(h, w) for w in ws]
    return [
        _as_heads(o, cos, sin, head_dim, r, f, g, head_norm_eps)
        for o, r, f, g in zip(outs, rope, first, hn)
    ]


@norm_projections.register_fake
def _(
    x, nw, eps, ws, cos=None, sin=None, head_dim=0, rope=None, heads_first=None,
    head_norms=None, head_normed=None, head_norm_eps=0.0,
):  # fmt: skip
    first = list(heads_first) if heads_first else [False] * len(ws)
    out = []
    for w, f in zip(ws, first):
        if f:
            b, s = x.shape[0], x.shape[1]
            out.append(x.new_empty((b, w.shape[0] // head_dim, s, head_dim)))
        else:
            out.append(x.new_empty((*x.shape[:-1], w.shape[0])))
    return out


def _per_output(weights, flags, n: int) -> list:
    """The head-norm weight of each of ``n`` outputs (None: not normed); a
    flag list and weight count that disagree give a list of the wrong length."""
    if not flags:
        return [None] * n
    it = iter(weights or [])
    out = [next(it, None) if f else None for f in flags]
    return (
        out
        if next(it, None) is None and all(w is not None for w, f in zip(out, flags) if f)
        else []
    )


def _heads_args_ok(x, ws, cos, sin, head_dim, rope, first, hn) -> bool:
    if head_dim <= 0 or len(rope) != len(ws) or len(first) != len(ws) or len(hn) != len(ws):
        return False
    if any(g is not None and tuple(g.shape) != (head_dim,) for g in hn):
        return False
    # [b, s, K]; or rows [t, K] (vLLM), the outputs token-major
    if any(w.shape[0] % head_dim for w in ws) or x.dim() not in (2, 3):
        return False
    if x.dim() == 2 and any(first):
        return False
    if not any(rope):
        return True
    if cos is None or sin is None or head_dim % 2:
        return False
    if x.dim() == 2:
        return all(t.shape == (x.shape[0], head_dim) for t in (cos, sin))
    b, s = x.shape[0], x.shape[1]
    return all(t.shape in ((1, s, head_dim), (b, s, head_dim)) for t in (cos, sin))


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _as_heads(
    o, cos, sin, head_dim: int, rope: bool, first: bool, hn=None, hn_eps: float = 0.0
) -> torch.Tensor:
    """Output ``o`` [b, s, N] (or [t, N]) as the op gives it (see
    ``norm_projections``)."""
    if not (rope or first or hn is not None):
        return o
    lead = o.shape[:-1]
    o = o.view(*lead, -1, head_dim)
    if hn is not None:
        o = rms_norm(o, hn, hn_eps)
    if first:
        o = o.transpose(1, 2)
    if rope:
        at = 1 if first else len(lead)  # the heads dim the tables broadcast over
        o = o * cos.unsqueeze(at) + _rotate_half(o) * sin.unsqueeze(at)
    return o.contiguous() if first else o.reshape(*lead, -1)


def _device_projections(
    x, nw, eps: float, ws, cos=None, sin=None, head_dim=0, rope=(), first=(), hn=(), hn_eps=0.0,
    cache=None,
):  # fmt: skip
    """The outputs of one program on the card, or None when none serves the
    call.  ``cache``: (caches, positions [m] int32 on the host, cache rows,
    rows a descriptor writes): the last outputs are written into the caches
    at those rows, and only the first is returned."""
    from torch_spyre.kernels.projections import Heads, best_norm_projections, projection_block

    k = x.shape[-1]
    if x.dtype not in _FLOATS or x.numel() == 0 or not ws:
        return None
    if any(w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype for w in ws):
        return None
    if nw is not None and (nw.shape != (k,) or nw.dtype != x.dtype):
        return None
    widths = tuple(int(w.shape[0]) for w in ws)
    if projection_block(widths, x.dtype) is None:
        return None
    lead = tuple(x.shape[:-1])
    b, m, batched, xx = activation_rows(x)
    heads = None
    normed = tuple(g is not None for g in hn) if any(g is not None for g in hn) else ()
    if any(rope) or any(first) or normed:
        if any(rope) and (cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != sin.shape):
            return None
        if any(g is not None and g.dtype != x.dtype for g in hn):
            return None
        # tables [1 or b, s, d]; rows' tables [t, d] are one batch
        cb = int(cos.shape[0]) if any(rope) and cos.dim() == 3 else 1
        cached: tuple[bool, ...] = ()
        length = run = 0
        if cache is not None:
            cached = (False,) * (len(ws) - len(cache[0])) + (True,) * len(cache[0])
            length, run = int(cache[2]), int(cache[3])
        heads = Heads(
            int(head_dim), tuple(bool(r) for r in rope), tuple(bool(f) for f in first), cb,
            normed, float(hn_eps) if normed else 0.0, cached, length, max(run, 1),
        )  # fmt: skip
    if cache is not None and heads is None:
        return None
    dev = x.device
    norm_eps = None if nw is None else eps
    # the weights as row blocks of one tensor (vLLM's merged qkv_proj): read in place
    whole_w = operands.row_blocks(list(ws))
    merged = whole_w is not None
    key = ("norm_projections", b, m, k, widths, x.dtype, batched, norm_eps, merged, heads)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        p = best_norm_projections(
            b, m, k, widths, x.dtype, norm_eps=norm_eps, batched=batched, config=cfg,
            heads=heads, merged=merged,
        )  # fmt: skip
        return launch.Kernel(p)

    try:
        kern = launch.kernel(key, build)
    except Exception:  # no plan fits (e.g. a core's span): the matmuls run apart
        return None
    if kern.program is None:
        return None
    outs = []
    for i, w in enumerate(widths):
        if heads is not None and heads.into_cache(i):
            outs.append(cache[0][i - (len(widths) - len(cache[0]))])
        elif heads is not None and heads.first[i]:
            outs.append(torch.empty((b, w // head_dim, m, head_dim), dtype=x.dtype, device=dev))
        else:
            outs.append(torch.empty((*lead, w), dtype=x.dtype, device=dev))
    bufs = {"x": operands.device_memory(xx)}
    if merged:
        bufs["w"] = whole_w
    for i, (w, o) in enumerate(zip(ws, outs)):
        if not merged:
            bufs[f"w{i}"] = operands.device_memory(operands.whole(w))
        bufs[f"out{i}"] = operands.device_memory(o if batched else o.view(m, widths[i]))
    if nw is not None:
        bufs["nw"] = operands.device_memory(operands.whole(nw))
    if heads is not None and any(heads.rope):
        bufs["cos"] = operands.device_memory(operands.whole(cos))
        bufs["sin"] = operands.device_memory(operands.whole(sin))
    for i, g in enumerate(hn):
        if g is not None:
            bufs[f"hn{i}"] = operands.device_memory(operands.whole(g))
    if cache is not None:
        bufs["pos"] = operands.device_memory(cache[1].to(dev))
    kern.launch_memory(dev.index or 0, bufs)
    dispatch_stats.record("kernel", "norm_projections")
    return outs[: len(widths) - len(cache[0])] if cache is not None else outs


@torch.library.custom_op(
    "spyre::norm_qkv_into_cache",
    mutates_args=("k_cache", "v_cache"),
    schema="(Tensor x, Tensor? nw, float eps, Tensor wq, Tensor wk, Tensor wv, "
    "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_position, Tensor? cos, Tensor? sin, "
    "SymInt head_dim, bool[] rope, Tensor[]? head_norms=None, bool[]? head_normed=None, "
    "float head_norm_eps=0.0) -> Tensor",
)
def norm_qkv_into_cache(
    x: torch.Tensor,
    nw: torch.Tensor | None,
    eps: float,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    head_dim: int,
    rope: list[bool],
    head_norms: list[torch.Tensor] | None = None,
    head_normed: list[bool] | None = None,
    head_norm_eps: float = 0.0,
) -> torch.Tensor:
    """``norm_projections`` of Q, K and V, all heads-first, with K and V
    written into a static KV cache instead of returned: ``k_cache[:, :,
    cache_position] = k`` (``index_copy_`` along dim 2, as transformers'
    ``StaticLayer.update``), likewise V; returns Q [b, heads, s, head_dim].
    On the card one program: the K and V tiles are stored to their cache rows
    (``kernels.projections.Heads.cached``), not to an output a second kernel
    copies from."""
    args = (x, nw, eps, [wq, wk, wv], cos, sin, head_dim, rope, [True] * 3, head_norms,
            head_normed, head_norm_eps)  # fmt: skip
    if x.device.type == "spyre":
        q = _device_into_cache(args, k_cache, v_cache, cache_position)
        if q is not None:
            return q[0]
    q, k, v = norm_projections(*args)
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    return q


@norm_qkv_into_cache.register_fake
def _(x, nw, eps, wq, wk, wv, k_cache, v_cache, cache_position, cos, sin, head_dim, rope,
      head_norms=None, head_normed=None, head_norm_eps=0.0):  # fmt: skip
    return x.new_empty((x.shape[0], wq.shape[0] // head_dim, x.shape[1], head_dim))


def _device_into_cache(args, k_cache, v_cache, cache_position) -> torch.Tensor | None:
    """Q, with K and V written into the caches by one program; None when
    this path does not serve the call (the composite then does)."""
    from torch_spyre.runtime import access

    x, ws, head_dim = args[0], args[3], args[6]
    caches = (k_cache, v_cache)
    if x.dim() != 3 or cache_position.dim() != 1 or cache_position.is_floating_point():
        return None
    b, s = x.shape[0], x.shape[1]
    if cache_position.numel() != s or cache_position.device != x.device:
        return None
    for c, w in zip(caches, ws[1:]):
        if (
            c.device != x.device
            or c.dtype != x.dtype
            or c.dim() != 4
            or tuple(c.shape) != (b, w.shape[0] // head_dim, k_cache.shape[2], head_dim)
            or not operands.is_whole_default(c)
        ):
            return None
    length = int(k_cache.shape[2])
    pos = access.read(cache_position).to(torch.int64)
    # index_copy_'s bounds: [0, length), no wrapping of negative positions
    if s and (int(pos.min()) < 0 or int(pos.max()) >= length):
        bad = int(pos.max()) if int(pos.max()) >= length else int(pos.min())
        raise IndexError(
            f"spyre::norm_qkv_into_cache: cache position {bad} is out of bounds for a "
            f"cache of {length} rows"
        )
    if s and pos.unique().numel() != s:
        return None  # a row written twice: index_copy_'s order, not one store
    run = s if s and torch.equal(pos, pos[0] + torch.arange(s)) else 1
    return _device_projections(
        *args[:6], head_dim, args[7], args[8], _per_output(args[9], args[10], 3), args[11],
        cache=(caches, pos.to(torch.int32), length, run),
    )  # fmt: skip
