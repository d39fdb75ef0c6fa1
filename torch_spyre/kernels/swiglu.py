"""The SwiGLU MLP as one kernel program (``swiglu_mlp``) and the split and
tiles the timing model finds fastest for it (``best_swiglu_mlp``); re-exported
by ``kernels.basic``.  Used by the eager and compiled MLP op (``ops/mlp.py``) and
the grouped experts of a mixture of experts (``kernels/moe.py``)."""

from __future__ import annotations

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Buffer,
    Dim,
    Load,
    Matmul,
    Operand,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    Store,
    Vector,
)
from torch_spyre.kernels.search import REJECTED, persisted
from torch_spyre.kernels.splits import double_if_it_fits, row_block_extents, row_block_plans
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems


def swiglu_mlp(
    b: int,
    m: int,
    k: int,
    n: int,
    e: int | None,
    dtype: torch.dtype = torch.float16,
    *,
    split: tuple[int, int, int] | None = None,
    tiles: tuple[int, int, int] | None = None,
    double_buffer: bool = True,
    batched: bool = True,
    residual: float | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
    tb: int = 1,
    merged: bool = False,
    norm_eps: float | None = None,
    keep_stream: bool = False,
    double_out: bool = False,
    proj: tuple[int, float] | tuple[int, float, bool] | None = None,
    tj: int = 64,
) -> Program:
    """``out = (silu(x @ wg^T) * (x @ wu^T)) @ wd^T`` in one program.

    Two matmuls share the activation tile (loaded once per core, whole k):
    per column block of ``tn`` hidden units the gate and up weight tiles
    stream through the LX (k tiles of ``tk``) into two fp32 accumulators;
    ``silu(g) * u`` runs on the vector units in LX, and the down projection
    consumes that hidden tile at once (``out += h @ wd[:, block]^T``,
    accumulated over the blocks), so the hidden activation never reaches
    device memory.  Weight tiles shared by the cores splitting rows are read
    once per group and multicast over the ring; with the hidden dim split over
    cores the partial outputs are combined by a ring all-reduce.  ``e=None``:
    no down projection (the output is the hidden activation).

    ``k`` over cores (``split``'s 4th entry, ``E == K`` only): each core holds
    a band of k sticks of the activation, gate and up weights (``wg``/``wu``
    are ``[N, K]`` with K the stick dim, so a hidden-dim slice of them spans
    the whole tensor in device memory while a k band is contiguous: this is
    what keeps a core inside its 256 MiB span when the weights are larger);
    the gate and up partial sums of each hidden block are combined by a ring
    all-reduce before ``silu(g) * u``, and the down projection then writes
    the same k band of the output columns (``wd``'s hidden slice of that band),
    so the activation and the output accumulator in LX shrink by the split too.

    Operands (nn.Linear weights): ``x`` [b, m, k] (``batched=False``:
    [m, k]), ``wg``, ``wu`` [n, k], ``wd`` [e, n], ``out`` [b, m, e or n].
    ``split``: cores over (b, m, n) or (b, m, n, k); ``tiles``: (tm, tn, tk);
    ``tb``: batch elements per tile (a decode step's ``[B, 1, K]`` is B rows of
    one token: with ``tb`` > 1 every weight tile serves ``tb * tm`` rows instead
    of being streamed again for each batch element).

    ``merged``: the gate and up weights are the two row halves of one
    ``[2n, k]`` operand ``wgu`` (vLLM's merged ``gate_up_proj``), read in place
    through row offsets.

    ``norm_eps=eps`` (with ``residual``): the decoder layer's RMS norm before
    the MLP is the program's prologue, ``out = x + s * mlp(rms_norm(x) * nw)``
    with ``rms_norm(x) = (x * rsqrt(mean(x^2) + eps))`` rounded to the dtype
    (transformers' ``LlamaRMSNorm``), operand ``nw`` [k]: the residual
    stream ``x`` is read instead of the normed activation, normed in LX (its
    sum of squares all-reduced over the cores splitting k), and read again
    as the residual; the normed activation never reaches device memory.
    ``double_out``: the down projection's fp32 accumulator is double
    buffered, so a row block's store overlaps the next block's work instead
    of stalling it (twice its LX; ignored where a core has one row block).
    ``keep_stream``: the residual stream's tile stays in LX (buffer ``st``)
    for the residual add instead of being read again (one transfer fewer
    on every core's critical path, a row block of LX more).

    ``proj=(j, so[, flat])`` (with ``norm_eps``, batched): the attention's output
    projection and its residual add are the prologue too, so the program is
    a decoder layer's whole second half: ``x = res + so * (a @ wo^T)``,
    ``out = x + s * mlp(rms_norm(x) * nw)``, operands ``a`` [b, m, j] (the
    attention output, token-major; ``flat``: [m, j] with b == 1, the bytes
    of a 2-D attention output), ``wo`` [k, j] and ``res`` [b, m, k]
    instead of ``x``.  Each core contracts its row block's ``a`` with its k
    band of ``wo`` over ``j`` in tiles of ``tj`` (a loop of its own before
    the main loops: ``Program.branches``), into the fp32 accumulator the
    down projection later uses (``y``); the residual stream ``x`` then
    lives only in LX (``keep_stream``), never in device memory.  ``a`` is
    shared by the cores splitting n and k, ``wo``'s band by those splitting
    b, m and n (multicast).

    ``residual=s`` (with a down projection): ``out = res + s * mlp`` — the
    residual add of a decoder layer as the epilogue of the down projection
    (operand ``res``, shaped like ``out``, loaded per row block next to the
    output accumulator; one rounding on the store).
    """
    cfg = config or HardwareConfig()
    pb, pm, pn, pk = (*split, 1)[:4] if split is not None else (1, min(m, cfg.cores), 1, 1)
    pn, pk, en, ek, em, (tm, tn, tk) = row_block_extents(
        m, n, k, pm, pn, pk, stick_elems(dtype), tiles
    )
    acc = torch.float32 if dtype.is_floating_point else torch.int32
    down = e is not None
    if norm_eps is not None and (residual is None or e != k):
        raise ProgramError("swiglu_mlp: a norm prologue needs the residual add and E == K")
    flat = proj is not None and len(proj) > 2 and bool(proj[2])
    if proj is not None and (norm_eps is None or not batched or (flat and b != 1)):
        raise ProgramError(
            "swiglu_mlp: an output projection prologue needs the norm, batched (b == 1 for "
            "a [rows, j] attention output)"
        )
    if pk > 1 and e != k:
        # the k band of the output exists only when the output columns are k
        raise ProgramError("swiglu_mlp: a k split needs the down projection with E == K")
    dims = [
        Dim("b", b, pb, tb),
        Dim("m", m, pm, tm),
        Dim("n", n, pn, tn, chunk=en if pn > 1 else None),
        Dim("k", k, pk, tk, chunk=ek if pk > 1 else None),
    ]
    if down and e != k:
        dims.append(Dim("e", e, 1))
    if proj is not None:
        dims.append(Dim("j", proj[0], 1, min(tj, proj[0])))
    l2, l3, l4 = ("b", "m"), ("b", "m", "n"), ("b", "m", "n", "k")
    xi = ("b", "m", "k") if batched else ("m", "k")
    xb = ("b", "m", "k")
    hi = ("b", "m", "n")
    db = double_buffer
    w_mc = pb * pm > 1
    # merged: the up rows start n rows into the one gate/up operand
    wg_op, wu_op = ("wgu", "wgu") if merged else ("wg", "wu")
    wg_at, wu_at = ((0, 0), (n, 0)) if merged else ((), ())
    # with the output projection the stream exists only in LX: kept there
    keep = (keep_stream or proj is not None) and norm_eps is not None and batched
    steps: list = [
        *(
            [Load("st" if keep else "xt", "x", xi if batched else ("m", "k"), l2, multicast=pn > 1)]
            if proj is None
            else proj_prologue(proj[1], pb * pm * pn > 1, pn * pk > 1, pn > 1)
        ),
        *norm_prologue(norm_eps, k, pk > 1, l2, "st" if keep else "xt"),
        Load("wgt", wg_op, ("n", "k"), l4, multicast=w_mc, offsets=wg_at),
        Load("wut", wu_op, ("n", "k"), l4, multicast=w_mc, offsets=wu_at),
        Matmul("g", "xt", "wgt", l4),
        Matmul("u", "xt", "wut", l4),
        # k over cores: each holds a partial sum of the hidden block
        *(
            [RingAllReduce("g", "k", "sum", l3), RingAllReduce("u", "k", "sum", l3)]
            if pk > 1
            else []
        ),
        Vector("silu", "g", ("g",), (), l3),
        Vector("mul", "h", ("g", "u"), (), l3),
    ]
    x_dims = xb if batched else ("m", "k")
    # several row blocks per core: their buffers may alternate
    blocks = tm < em or tb < ceil_div(b, pb)
    buffers = [
        # one activation block per core is loaded once: no second copy
        # (with the output projection nothing loads it: the norm writes it)
        Buffer("xt", x_dims, dtype, db and blocks and proj is None),
        Buffer("wgt", ("n", "k"), dtype, db),
        Buffer("wut", ("n", "k"), dtype, db),
        Buffer("g", hi if batched else ("m", "n"), acc),
        Buffer("u", hi if batched else ("m", "n"), acc),
        Buffer("h", hi if batched else ("m", "n"), dtype, db and not down),
    ]
    rows = ("b", "m") if batched else ("m",)
    if down and e == k:
        # the output columns walk the k loop again (E == K in a transformer
        # MLP): a second k loop in the same hidden block streams wd in
        # [tk, tn] tiles into the resident output accumulator y[rows, E]
        steps += [
            Load("wdt", "wd", ("k", "n"), l4, multicast=w_mc),
            Matmul("y", "h", "wdt", l4),
        ]
        buffers += [
            Buffer("wdt", ("k", "n"), dtype, db),
            Buffer("y", (*rows, "k"), acc, double_out and blocks),
        ]
        if pn > 1:
            steps.append(RingAllReduce("y", "n", "sum", l2))
        steps.append(Store("out", "y", (*rows, "k"), l2))
    elif down:
        steps += [
            Load("wdt", "wd", ("e", "n"), l3, multicast=w_mc),
            Matmul("y", "h", "wdt", l3),
        ]
        buffers += [
            Buffer("wdt", ("e", "n"), dtype, db),
            Buffer("y", (*rows, "e"), acc, double_out and blocks),
        ]
        if pn > 1:
            steps.append(RingAllReduce("y", "n", "sum", l2))
        steps.append(Store("out", "y", (*rows, "e"), l2))
    else:
        steps.append(Store("out", "h", (*rows, "n"), l3))
    if residual is not None:
        if not down:
            raise ProgramError("swiglu_mlp: a residual needs the down projection")
        ecol = "k" if e == k else "e"
        # E == K: the activation tile is dead once the hidden blocks are
        # done, and the residual tile has its dims: load it into that LX
        rt = "st" if keep else "xt" if ecol == "k" and batched else "rt"
        store = steps.pop()
        steps += [
            # the cores splitting the hidden dim all add the same rows: read
            # once per group and shared over the ring, like the activation
            # (a norm prologue: the residual is the un-normed activation)
            *(
                []
                if keep
                else [
                    Load(
                        rt, "res" if norm_eps is None else "x", (*rows, ecol), l2, multicast=pn > 1
                    )
                ]  # fmt: skip
            ),
            Vector("mul_scalar", "y", ("y",), (float(residual),), l2),
            Vector("add", "y", ("y", rt), (), l2),
            store,
        ]
        if rt == "rt":
            buffers.append(Buffer("rt", (*rows, ecol), dtype))
    xs = (b, m, k) if batched else (m, k)
    outs = (b, m, e if down else n) if batched else (m, e if down else n)
    if not batched and b != 1:
        raise ProgramError("swiglu_mlp: an unbatched x needs b == 1")
    operands = [
        *(
            [Operand("x", SpyreTensorLayout.default(xs, dtype), "input")]
            if proj is None
            else [
                Operand("a", _attention_output(b, m, proj[0], dtype, flat), "input"),
                Operand("wo", SpyreTensorLayout.default((k, proj[0]), dtype), "input"),
                Operand("res", SpyreTensorLayout.default(xs, dtype), "input"),
            ]
        ),
        *(
            [Operand("wgu", SpyreTensorLayout.default((2 * n, k), dtype), "input")]
            if merged
            else [
                Operand("wg", SpyreTensorLayout.default((n, k), dtype), "input"),
                Operand("wu", SpyreTensorLayout.default((n, k), dtype), "input"),
            ]
        ),
    ]
    if down:
        operands.append(Operand("wd", SpyreTensorLayout.default((e, n), dtype), "input"))
    if norm_eps is not None:
        operands.append(Operand("nw", SpyreTensorLayout.default((k,), dtype), "input"))
        buffers += [Buffer("rs", rows, acc), Buffer("nwt", ("k",), dtype)]
        if keep:
            buffers.append(Buffer("st", xb, dtype, db and blocks))
        if proj is not None:
            buffers += [
                Buffer("at", ("b", "m", "j"), dtype, db),
                Buffer("wot", ("k", "j"), dtype, db),
            ]
    elif residual is not None:
        operands.append(Operand("res", SpyreTensorLayout.default(outs, dtype), "input"))
    operands.append(Operand("out", SpyreTensorLayout.default(outs, dtype), "output"))
    if not batched:
        # an unbatched program has no b dim in its buffers: drop it
        dims = [d for d in dims if d.name != "b"]
        loops = tuple(x for x in l4 if x != "b")
        steps = [
            type(s)(**{**s.__dict__, "loops": tuple(x for x in s.loops if x != "b")}) for s in steps
        ]
        order = loops
    else:
        order = ("b", "m", "j", "n", "k") if proj is not None else l4
    return Program(
        name=name
        or f"swiglu_mlp_{b * m}x{k}x{n}"
        + (f"x{e}" if down else "")
        + ("_res" if residual is not None else "")
        + ("_norm" if norm_eps is not None else "")
        + (f"_oproj{proj[0]}" if proj is not None else ""),
        dims=tuple(dims),
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=order,
    )


def _attention_output(b: int, m: int, j: int, dtype: torch.dtype, flat: bool) -> SpyreTensorLayout:
    """The layout of the output projection's input ``a`` [b, m, j]: the default
    one, or (``flat``, b == 1) the bytes of a default [m, j] tensor (vLLM's
    [T, H * D]: column sticks outermost) under the host shape [1, m, j]."""
    if not flat:
        return SpyreTensorLayout.default((b, m, j), dtype)
    two = SpyreTensorLayout.default((m, j), dtype)
    return SpyreTensorLayout((1, m, j), two.device_size, tuple(d + 1 for d in two.dim_map), dtype)


def proj_prologue(so: float, wo_shared: bool, a_shared: bool, res_shared: bool) -> list:
    """The output projection and residual add before a decoder layer's MLP
    (``swiglu_mlp(proj=)``): ``y = a @ wo^T`` over the ``j`` tiles (its
    own loop), then the stream ``st = res + so * y`` rounded to the dtype
    (one rounding, as the fused epilogue of a matmul); ``res`` is loaded into
    ``st`` and the stream replaces it there."""
    lj = ("b", "m", "j")
    l2 = ("b", "m")
    return [
        Load("at", "a", ("b", "m", "j"), lj, multicast=a_shared),
        Load("wot", "wo", ("k", "j"), lj, multicast=wo_shared),
        Matmul("y", "at", "wot", lj),
        Load("st", "res", ("b", "m", "k"), l2, multicast=res_shared),
        Vector("mul_scalar", "y", ("y",), (float(so),), l2),
        Vector("add", "st", ("y", "st"), (), l2),
    ]


def norm_prologue(
    eps: float | None, k: int, k_split: bool, loops: tuple[str, ...], src: str
) -> list:
    """The RMS norm of the tile ``src`` into the activation tile ``xt``: its
    rows' sum of squares (all-reduced when k is split over cores),
    ``rsqrt(mean + eps)``, the product rounded to the dtype, then times the
    weight ``nw``."""
    if eps is None:
        return []
    return [
        Reduce("sumsq", "rs", src, "k", loops),
        *([RingAllReduce("rs", "k", "sum", loops)] if k_split else []),
        Vector("mul_scalar", "rs", ("rs",), (1.0 / k,), loops),
        Vector("add_scalar", "rs", ("rs",), (float(eps),), loops),
        Vector("rsqrt", "rs", ("rs",), (), loops),
        Vector("mul", "xt", (src, "rs"), (), loops),
        Load("nwt", "nw", ("k",), loops),
        Vector("mul", "xt", ("nwt", "xt"), (), loops),
    ]


@persisted("swiglu")
def best_swiglu_mlp(
    b: int,
    m: int,
    k: int,
    n: int,
    e: int | None,
    dtype: torch.dtype = torch.float16,
    *,
    batched: bool = True,
    residual: float | None = None,
    config: HardwareConfig | None = None,
    name: str | None = None,
    merged: bool = False,
    norm_eps: float | None = None,
    proj: tuple[int, float] | tuple[int, float, bool] | None = None,
) -> Program:
    """The fused SwiGLU MLP program the timing model finds fastest: core
    splits over (b, rows, hidden, k) and tiles (batch, rows, hidden block, k)
    that fit the LX and a core's address span.

    k over cores is what plans weights whose hidden slices span more than a
    core's 256 MiB (Llama-3.1-70B: 8192 x 28672, 14336 per card at TP 2);
    a batch tile of the whole per-core batch lets a decode step's weight
    tiles serve all its requests at once."""
    from torch_spyre.kernels.search import Search

    cfg = config or HardwareConfig()

    def build(c: tuple) -> Program:
        (pb, pm, pn, pk), (tb, tm, tn, tk), keep, tj = c

        def program(double_out: bool) -> Program:
            return swiglu_mlp(
                b, m, k, n, e, dtype, split=(pb, pm, pn, pk), tiles=(tm, tn, tk),
                batched=batched, residual=residual, config=cfg, name=name, tb=tb,
                merged=merged, norm_eps=norm_eps, keep_stream=keep, double_out=double_out,
                proj=proj, tj=tj,
            )  # fmt: skip

        return double_if_it_fits(program, cfg)

    found = Search(build, cfg, margin=1e-12, rejected=(ProgramError,))
    if proj is not None:
        # the output projection's prologue on the plain program's plan (its
        # split and tiles: the MLP is most of the work), in the contraction
        # tiles that fit; the whole search only when none does (a search per
        # plan and tile would double a cold compile's MLP planning)
        base = plain_swiglu_mlp(b, m, k, n, e, dtype, residual, cfg, merged, norm_eps)
        dims = {d.name: d for d in base.dims}
        split = tuple(dims[x].cores if x in dims else 1 for x in "bmnk")
        tiles = tuple(dims[x].tile_size if x in dims else 1 for x in "bmnk")
        found.run((split, tiles, True, tj) for tj in (64, 128, 256))
        if found.best is not None:
            return found.best.result
    # with a norm prologue: the residual stream kept in LX, or read again
    # (with the output projection it is only ever in LX)
    keeps = (False, True) if norm_eps is not None and batched and proj is None else (True,)
    # the output projection's contraction tiles
    tjs = (64, 128, 256) if proj is not None else (64,)
    # a k split needs the output columns to be k
    plans = row_block_plans(
        b, m, k, n, cfg.cores, stick_elems(dtype), batched=batched, k_split=e == k
    )
    for split, tiles in plans:
        found.run((split, t, keep, tj) for t in tiles for keep in keeps for tj in tjs)
    if found.best is None:
        raise ProgramError(f"fused SwiGLU MLP {b * m}x{k}x{n}: no plan fits the card")
    return found.best.result


def plain_swiglu_mlp(
    b: int,
    m: int,
    k: int,
    n: int,
    e: int | None,
    dtype: torch.dtype,
    residual: float | None,
    config: HardwareConfig,
    merged: bool = False,
    norm_eps: float | None = None,
    batched: bool = True,
) -> Program:
    """``best_swiglu_mlp`` without the output projection, called as the op
    (``ops/mlp.py``) calls it: one entry of its cache for the op,
    ``proj_pays`` and the prologue's plan."""
    return best_swiglu_mlp(
        b, m, k, n, e, dtype, batched=batched, residual=residual, config=config, merged=merged,
        norm_eps=norm_eps, proj=None,
    )  # fmt: skip


@persisted("swiglu_proj")
def proj_pays(
    b: int,
    m: int,
    k: int,
    n: int,
    j: int,
    dtype: torch.dtype,
    so: float,
    eps: float,
    scale: float,
    config: HardwareConfig | None = None,
) -> bool:
    """Whether the MLP program with the output projection as its prologue
    (``swiglu_mlp(proj=)``) is modelled faster than the two kernels it
    replaces: the projection with its residual add as a matmul of its own
    (planned as compiled alone, ``kernels.eager.matmul``) and the MLP from
    the stream it stores.  In prefill it is (the stream's store and reload
    go, and the projection's weight streams under one launch); in a decode
    step the MLP's split (hidden units over cores) makes the prologue
    slower than the projection's own plan, and the kernels stay apart."""
    from torch_spyre.kernels.eager import matmul
    from torch_spyre.sim import estimate

    cfg = config or HardwareConfig()
    rows = b * m
    try:
        fused = best_swiglu_mlp(
            b, m, k, n, k, dtype, residual=scale, config=cfg, norm_eps=eps, proj=(j, so)
        )
        mlp = plain_swiglu_mlp(b, m, k, n, k, dtype, scale, cfg, norm_eps=eps)
        oproj = matmul(
            (rows, j), ("m0", "k"), (k, j), ("n", "k"), (rows, k), ("m0", "n"),
            {"m0": rows, "n": k, "k": j}, dtype, bias=((rows, k), ("m0", "n")), alpha=so,
            config=cfg,
        )  # fmt: skip
    except REJECTED:  # a program that does not fit: the kernels as they were
        return False
    apart = estimate(mlp, cfg).time_s + estimate(oproj, cfg).time_s
    return estimate(fused, cfg).time_s < apart
