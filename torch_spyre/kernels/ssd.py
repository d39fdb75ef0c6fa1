"""The Mamba-2 state-space scans as kernel programs (the SSD chunked form and the step).

Notation of transformers' ``mamba2_chunk_scan``: positions are cut into
chunks of ``L`` (c chunks), ``h`` heads of ``p`` channels, ``n`` state size;
``xd = x * dt`` and ``acum`` = the within-chunk cumulative sum of
``dA = A * dt`` are made by the eager producer (``ops/ssm.py``).

``ssd_chunk_scan`` is one grouped kernel (``sim.grouped``) of three phases,
the decomposition of the fused Mamba-2 kernels:

1. **chunk states** (chunks and heads over the cores): each chunk's state
   ``S_c = sum_s xd_s (x) B_s exp(acum_last - acum_s)`` (a PE-array
   contraction over the chunk's positions) and its decay ``exp(acum_last)``;
2. **state passing** (heads over the cores, **chunks in order**): the
   recurrence ``E_c = exp(acum_last_c) * E_{c-1} + S_c`` from the initial
   state, a sequential ``Scan`` along the chunks; the state entering chunk c
   is stored at slot c of ``enter`` (slot 0: the initial state, slot C: the
   final state);
3. **chunk outputs** (chunks and heads over the cores): the intra-chunk part
   ``(C_l . B_s) * exp(acum_l - acum_s)`` masked to ``s <= l``, times ``xd``,
   plus the inter-chunk part ``(C_l . enter_c) * exp(acum_l)``, plus
   ``D * x``.

Only phase 2 is sequential along the sequence, over chunks (C steps of an
``h x p x n`` multiply-add): the quadratic work is within chunks, on the PE
arrays, as on a GPU.  ``ssm_step`` is the recurrent form of a decode step:
``state = exp(dt A) * state + dt x (x) B``, ``y = state . C + D x``.
"""

from __future__ import annotations

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Buffer,
    Dim,
    GroupedProgram,
    Load,
    Matmul,
    Operand,
    Program,
    Reduce,
    Scan,
    Store,
    Vector,
)
from torch_spyre.layout import SpyreTensorLayout, ceil_div

F32 = torch.float32


def _split(sizes: dict[str, int], order: tuple[str, ...], cores: int) -> dict[str, int]:
    """Cores per dim: greedily over ``order`` (independent work)."""
    out = dict.fromkeys(sizes, 1)
    left = cores
    for d in order:
        c = max(1, min(left, sizes[d]))
        while left % c:
            c -= 1
        out[d] = c
        left //= c
    return out


def ssd_chunk_scan(
    b: int,
    c: int,
    chunk: int,
    g: int,
    hg: int,
    p: int,
    n: int,
    x_dtype: torch.dtype = F32,
    *,
    l_tile: int | None = None,
    config: HardwareConfig | None = None,
) -> GroupedProgram:
    """Heads come in ``g`` groups of ``hg`` sharing B and C (h = g * hg).

    Operands (fp32 unless said): ``xd``, ``x`` (``x_dtype``), ``y`` [b, c, L, g,
    hg, p]; ``acum`` [b, c, L, g, hg]; ``B``, ``C`` [b, c, L, g, n]; ``D`` [g, hg];
    ``init`` [b, g, hg, p, n]; ``mask`` [L, L] (1 where s <= l); intermediates
    ``states`` [b, c, g, hg, p, n], ``cdec`` [b, c, g, hg, 1] (one stick per
    chunk and head: cores splitting heads never share a stick); ``enter``
    [b, c + 1, g, hg, p, n] (slot c: the state entering chunk c; slot C: the
    final state).  ``C . B`` is computed once per group, as in the SSD form."""
    cfg = config or HardwareConfig()
    L = chunk
    lay = SpyreTensorLayout.default
    hd = ("g", "j")  # a head: its group, its index in the group
    ops = {
        "xd": Operand("xd", lay((b, c, L, g, hg, p), F32)),
        "x": Operand("x", lay((b, c, L, g, hg, p), x_dtype)),
        "acum": Operand("acum", lay((b, c, L, g, hg), F32)),
        "B": Operand("B", lay((b, c, L, g, n), F32)),
        "C": Operand("C", lay((b, c, L, g, n), F32)),
        "D": Operand("D", lay((g, hg), F32)),
        "init": Operand("init", lay((b, g, hg, p, n), F32)),
        "mask": Operand("mask", lay((L, L), F32)),
    }
    states = lay((b, c, g, hg, p, n), F32)
    cdec = lay((b, c, g, hg, 1), F32)
    enter = lay((b, c + 1, g, hg, p, n), F32)
    y = lay((b, c, L, g, hg, p), F32)
    # chunks are the outermost device dim: cores over chunks keep each core's
    # address span to its chunks
    sp = _split({"b": b, "c": c, "g": g, "j": hg}, ("c", "j", "g", "b"), cfg.cores)
    dims_bcgj = (
        Dim("b", b, sp["b"], 1),
        Dim("c", c, sp["c"], 1),
        Dim("g", g, sp["g"], 1),
        Dim("j", hg, sp["j"], 1),
    )
    l4 = ("b", "c", "g", "j")

    # ---- phase 1: chunk states
    p1 = Program(
        f"ssd_states_{b}x{c}x{L}x{g * hg}x{p}x{n}",
        dims=(*dims_bcgj, Dim("s", L), Dim("p", p), Dim("n", n)),
        operands=(
            ops["acum"],
            ops["B"],
            ops["xd"],
            Operand("states", states, "output"),
            Operand("cdec", cdec, "output"),
        ),
        buffers=(
            Buffer("as_", (*l4, "s"), F32, True),
            Buffer("alast", l4, F32, True),
            Buffer("dec", (*l4, "s"), F32),
            Buffer("Bt", ("b", "c", "g", "s", "n"), F32, True),
            Buffer("Bd", (*l4, "s", "n"), F32),
            Buffer("xt", (*l4, "s", "p"), F32, True),
            Buffer("st", (*l4, "p", "n"), F32, True),
            Buffer("ea", l4, F32, True),
        ),
        steps=(
            # B is shared by the heads of a group: loaded once per group
            Load("Bt", "B", ("b", "c", "s", "g", "n"), l4[:3]),
            Load("as_", "acum", ("b", "c", "s", *hd), l4),
            Load("alast", "acum", ("b", "c", None, *hd), l4, offsets=(0, 0, L - 1, 0, 0)),
            Vector("sub", "dec", ("alast", "as_"), (), l4),
            Vector("exp", "dec", ("dec",), (), l4),
            Vector("mul", "Bd", ("Bt", "dec"), (), l4),
            Load("xt", "xd", ("b", "c", "s", *hd, "p"), l4),
            Matmul("st", "xt", "Bd", l4),
            Store("states", "st", ("b", "c", *hd, "p", "n"), l4),
            Vector("exp", "ea", ("alast",), (), l4),
            Store("cdec", "ea", ("b", "c", *hd, None), l4),
        ),
        loop_order=l4,
    )

    # ---- phase 2: state passing, chunk after chunk
    sp2 = _split({"b": b, "g": g, "j": hg, "p": p}, ("j", "g", "b", "p"), cfg.cores)
    p2 = Program(
        f"ssd_passing_{b}x{c}x{g * hg}x{p}x{n}",
        dims=(
            Dim("b", b, sp2["b"]),
            Dim("g", g, sp2["g"]),
            Dim("j", hg, sp2["j"]),
            Dim("p", p, sp2["p"]),
            Dim("n", n),
            Dim("c", c, 1, 1),
        ),
        operands=(
            ops["init"],
            Operand("cdec", cdec, "input"),
            Operand("states", states, "input"),
            Operand("enter", enter, "output"),
        ),
        buffers=(
            Buffer("it", ("b", *hd, "p", "n"), F32),
            Buffer("at", ("b", "c", *hd), F32, True),
            Buffer("ut", ("b", "c", *hd, "p", "n"), F32, True),
            Buffer("E", ("b", "c", *hd, "p", "n"), F32, True),
        ),
        steps=(
            Load("it", "init", ("b", *hd, "p", "n")),
            Store("enter", "it", ("b", None, *hd, "p", "n"), (), offsets=(0,) * 6),
            Load("at", "cdec", ("b", "c", *hd, None), ("c",)),
            Load("ut", "states", ("b", "c", *hd, "p", "n"), ("c",)),
            Scan("linrec", "E", ("at", "ut", "it"), "c", ("c",)),
            Store("enter", "E", ("b", "c", *hd, "p", "n"), ("c",), offsets=(0, 1, 0, 0, 0, 0)),
        ),
        loop_order=("c",),
    )

    # ---- phase 3: chunk outputs (whole chunks in LX: C . B once per group, then
    # each head of the group; ``l_tile`` rows of the chunk at a time if given)
    tl = l_tile or L
    l3 = l4[:3]
    rows = (*l4, "l") if tl < L else l4
    p3 = Program(
        f"ssd_outputs_{b}x{c}x{L}x{g * hg}x{p}x{n}",
        dims=(
            *dims_bcgj,
            Dim("l", L, 1, tl if tl < L else None),
            Dim("s", L),
            Dim("p", p),
            Dim("n", n),
        ),
        operands=(
            ops["D"],
            ops["mask"],
            ops["C"],
            ops["B"],
            ops["acum"],
            ops["xd"],
            Operand("enter", enter, "input"),
            ops["x"],
            Operand("y", y, "output"),
        ),
        buffers=(
            Buffer("Dt", hd, F32),
            Buffer("mk", ("l", "s"), F32),
            Buffer("Ct", ("b", "c", "g", "l", "n"), F32, True),
            Buffer("Bt", ("b", "c", "g", "s", "n"), F32, True),
            Buffer("G", ("b", "c", "g", "l", "s"), F32),
            Buffer("al", (*l4, "l"), F32, True),
            Buffer("as_", (*l4, "s"), F32, True),
            Buffer("seg", (*l4, "l", "s"), F32),
            Buffer("xt", (*l4, "s", "p"), F32, True),
            Buffer("yd", (*l4, "l", "p"), F32, True),
            Buffer("St", (*l4, "p", "n"), F32, True),
            Buffer("yo", (*l4, "l", "p"), F32),
            Buffer("ea", (*l4, "l"), F32),
            Buffer("xr", (*l4, "l", "p"), x_dtype, True),
        ),
        steps=(
            Load("Dt", "D", hd, ()),
            Load("mk", "mask", ("l", "s"), ()),
            # per group: C . B, shared by its heads
            Load("Ct", "C", ("b", "c", "l", "g", "n"), l3),
            Load("Bt", "B", ("b", "c", "s", "g", "n"), l3),
            Matmul("G", "Ct", "Bt", l3),
            # per head: the decay mask, the intra- and inter-chunk parts, D x
            Load("al", "acum", ("b", "c", "l", *hd), rows),
            Load("as_", "acum", ("b", "c", "s", *hd), rows),
            Vector("sub", "seg", ("al", "as_"), (), rows),
            Vector("keep_or_fill", "seg", ("seg", "mk"), (float("-inf"),), rows),
            Vector("exp", "seg", ("seg",), (), rows),
            Vector("mul", "seg", ("G", "seg"), (), rows),
            Load("xt", "xd", ("b", "c", "s", *hd, "p"), rows),
            Matmul("yd", "seg", "xt", rows),
            Load("St", "enter", ("b", "c", *hd, "p", "n"), rows, offsets=(0,) * 6),
            Matmul("yo", "Ct", "St", rows),
            Vector("exp", "ea", ("al",), (), rows),
            Vector("mul", "yo", ("yo", "ea"), (), rows),
            Vector("add", "yd", ("yd", "yo"), (), rows),
            Load("xr", "x", ("b", "c", "l", *hd, "p"), rows),
            Vector("mul", "yo", ("xr", "Dt"), (), rows),
            Vector("add", "yd", ("yd", "yo"), (), rows),
            Store("y", "yd", ("b", "c", "l", *hd, "p"), rows),
        ),
        loop_order=rows,
    )
    return GroupedProgram(f"ssd_chunk_scan_{b}x{c * L}x{g * hg}x{p}x{n}", (p1, p2, p3))


def ssm_step(
    b: int,
    g: int,
    hg: int,
    p: int,
    n: int,
    dtype: torch.dtype = F32,
    *,
    state_dtype: torch.dtype = F32,
    config: HardwareConfig | None = None,
) -> Program:
    """One decode step of the recurrence, in place on the state (h = g * hg heads).

    Operands: ``state`` [b, g, hg, p, n] (``state_dtype``, inout; computed in fp32), ``x`` [b, g, hg, p]
    (``dtype``), ``dt`` [b, g, hg] fp32 (after softplus), ``A``, ``D`` [g, hg]
    fp32, ``B``, ``C`` [b, g, n] fp32, ``y`` [b, g, hg, p] (``dtype``)."""
    cfg = config or HardwareConfig()
    sp = _split({"b": b, "g": g, "j": hg}, ("j", "g", "b"), cfg.cores)
    lay = SpyreTensorLayout.default
    hd = ("g", "j")
    return Program(
        f"ssm_step_{b}x{g * hg}x{p}x{n}",
        dims=(
            Dim("b", b, sp["b"]),
            Dim("g", g, sp["g"]),
            Dim("j", hg, sp["j"]),
            Dim("p", p),
            Dim("n", n),
        ),
        operands=(
            Operand("state", lay((b, g, hg, p, n), state_dtype), "inout"),
            Operand("x", lay((b, g, hg, p), dtype)),
            Operand("dt", lay((b, g, hg), F32)),
            Operand("A", lay((g, hg), F32)),
            Operand("D", lay((g, hg), F32)),
            Operand("B", lay((b, g, n), F32)),
            Operand("C", lay((b, g, n), F32)),
            Operand("y", lay((b, g, hg, p), dtype), "output"),
        ),
        buffers=(
            Buffer("dtt", ("b", *hd), F32),
            Buffer("At", hd, F32),
            Buffer("Dt", hd, F32),
            Buffer("da", ("b", *hd), F32),
            Buffer("xt", ("b", *hd, "p"), F32),
            Buffer("xdt", ("b", *hd, "p"), F32),
            Buffer("Bt", ("b", "g", "n"), F32),
            Buffer("Ct", ("b", "g", "n"), F32),
            Buffer("st", ("b", *hd, "p", "n"), F32),
            Buffer("dbx", ("b", *hd, "p", "n"), F32),
            Buffer("yt", ("b", *hd, "p"), F32),
            Buffer("dx", ("b", *hd, "p"), F32),
        ),
        steps=(
            Load("dtt", "dt", ("b", *hd)),
            Load("At", "A", hd),
            Load("Dt", "D", hd),
            Vector("mul", "da", ("dtt", "At")),
            Vector("exp", "da", ("da",)),
            Load("xt", "x", ("b", *hd, "p")),
            Vector("mul", "xdt", ("xt", "dtt")),
            Load("Bt", "B", ("b", "g", "n")),
            Vector("mul", "dbx", ("xdt", "Bt")),
            Load("st", "state", ("b", *hd, "p", "n")),
            Vector("mul", "st", ("st", "da")),
            Vector("add", "st", ("st", "dbx")),
            Store("state", "st", ("b", *hd, "p", "n")),
            Load("Ct", "C", ("b", "g", "n")),
            Matmul("yt", "st", "Ct"),
            Vector("mul", "dx", ("xt", "Dt")),
            Vector("add", "yt", ("yt", "dx")),
            Store("y", "yt", ("b", *hd, "p")),
        ),
    )


def rmsnorm_gated(
    m: int,
    k: int,
    eps: float,
    dtype: torch.dtype = F32,
    w_dtype: torch.dtype | None = None,
    *,
    z_dtype: torch.dtype | None = None,
    config: HardwareConfig | None = None,
) -> Program:
    """``out = w * rmsnorm(x * silu(z))`` over rows of ``k`` (one group): the
    gated RMSNorm of Mamba-2 layers.  Operands ``x`` [m, k] (``dtype``), ``z``
    [m, k] (``z_dtype``, default ``dtype``),
    ``w`` [k] (``w_dtype``), ``out`` [m, k] (``dtype``: the weight multiplies
    the normalised row cast back to the input's dtype, as transformers does)."""
    cfg = config or HardwareConfig()
    wd = w_dtype or dtype
    zd = z_dtype or dtype
    cores = max(1, min(cfg.cores, m))
    em = ceil_div(m, cores)
    row32 = ceil_div(k, 32) * 32 * 4
    rows = max(1, min(em, (cfg.lx_bytes // 2 - row32) // (8 * row32)))
    loops = ("m",)
    lay = SpyreTensorLayout.default
    steps = [
        Load("wt", "w", ("k",), ()),
        Load("xt", "x", ("m", "k"), loops),
        Load("zt", "z", ("m", "k"), loops),
        Vector("silu", "sz", ("zt",), (), loops),
        Vector("mul", "g", ("xt", "sz"), (), loops),
        Vector("square", "sq", ("g",), (), loops),
        Reduce("sum", "ss", "sq", "k", loops),
        Vector("mul_scalar", "ss", ("ss",), (1.0 / k,), loops),
        Vector("add_scalar", "ss", ("ss",), (eps,), loops),
        Vector("rsqrt", "ss", ("ss",), (), loops),
        Vector("mul", "y", ("g", "ss"), (), loops),
    ]
    if dtype != F32:
        # transformers rounds the normalised row to the input dtype before the weight
        steps.append(Vector("copy", "yr", ("y",), (), loops))
        steps.append(Vector("mul", "y", ("yr", "wt"), (), loops))
    else:
        steps.append(Vector("mul", "y", ("y", "wt"), (), loops))
    steps.append(Store("out", "y", ("m", "k"), loops))
    buffers = [
        Buffer("wt", ("k",), F32),
        Buffer("xt", ("m", "k"), dtype, True),
        Buffer("zt", ("m", "k"), zd, True),
        Buffer("sz", ("m", "k"), F32),
        Buffer("g", ("m", "k"), F32),
        Buffer("sq", ("m", "k"), F32),
        Buffer("ss", ("m",), F32),
        Buffer("y", ("m", "k"), F32, True),
    ]
    if dtype != F32:
        buffers.append(Buffer("yr", ("m", "k"), dtype))
    return Program(
        f"rmsnorm_gated_{m}x{k}",
        dims=(Dim("m", m, cores, rows), Dim("k", k)),
        operands=(
            Operand("x", lay((m, k), dtype)),
            Operand("z", lay((m, k), zd)),
            Operand("w", lay((k,), wd)),
            Operand("out", lay((m, k), dtype), "output"),
        ),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )
