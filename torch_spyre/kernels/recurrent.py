"""Recurrent layers (RNN, LSTM, GRU) as kernel programs; used by ``ops/recurrent.py``.

The recurrence is sequential in time, and the programs are cut along it:

* ``input_projection``: ``xp[t, g] = x[t] @ w_ih[g]^T + bias[g]`` for every
  timestep and gate at once, one matmul program (the work that does not
  depend on the state).  The output is gate-major per step, ``[T, G, B, H]``,
  so a step reads each gate's block by row offsets (never a lane shift).
* ``recurrent_step``: one timestep: ``h @ w_hh[g]^T`` for each gate on the PE
  array, plus ``xp[t, g]``, the gate nonlinearities and the state update on
  the vector units, the LSTM projection (``proj_size``) when there is one,
  and an optional per-row mask that keeps the state of finished sequences
  (packed sequences).  The states live in ``hs`` ``[T + 1, B, K]``: a step
  reads row ``t`` (``t + 1`` backwards) and writes the next row, so the
  whole output sequence is ``hs`` without its initial row.  The cell state
  of an LSTM is updated in place.

A step depends on the one before (its ``h``), so a step is a program of its
own: the functional executor runs a program's steps over the whole
iteration space at once, and the card would need a barrier across cores
between timesteps anyway (a launch boundary models it).  Cores split the
batch rows and the hidden units of a step; splitting the hidden units of an
LSTM with a projection leaves partial projections, combined over the ring.
Both builders have a ``best_*`` form planned by the one search
(``kernels.search``).
"""

from __future__ import annotations

import itertools

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
    RingAllReduce,
    Store,
    Vector,
)
from torch_spyre.kernels.search import Memo, search
from torch_spyre.kernels.splits import stick_splits
from torch_spyre.layout import SpyreTensorLayout, ceil_div, stick_elems

#: gates per mode, in PyTorch's weight order
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_F32 = torch.float32
_memo = Memo(persist="recurrent")


def _pows(limit: int, at_most: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= min(limit, at_most)]


def input_projection(
    t: int,
    b: int,
    i: int,
    g: int,
    h: int,
    dtype: torch.dtype = torch.float16,
    *,
    bias: bool = True,
    batch_first: bool = False,
    split: tuple[int, int] = (1, 1),
    tiles: tuple[int, int, int] | None = None,
    config: HardwareConfig | None = None,
) -> Program:
    """``out[t, g, b, :] = x[t, b] @ w[g*h:(g+1)*h]^T + bias[g]``.

    Operands ``x`` [T, B, I] (``batch_first``: [B, T, I]), ``w`` [G*H, I] (the
    layer's ``weight_ih`` as stored), ``bias`` [G, H], ``out`` [T, G, B, H].
    ``split``: cores over (T, H); ``tiles``: (tt, tn, tk).  The x tile is loaded
    once per (t, n, k) block and serves every gate.  ``config`` is for
    symmetry with the other builders (the split is the caller's)."""
    pt, pn = split
    se = stick_elems(dtype)
    en = ceil_div(ceil_div(h, se), pn) * se if pn > 1 else h
    pn = ceil_div(h, en)
    et = ceil_div(t, pt)
    tt, tn, tk = tiles or (et, en, i)
    dims = (
        Dim("t", t, pt, tt),
        Dim("b", b),
        Dim("n", h, pn, tn, chunk=en if pn > 1 else None),
        Dim("k", i, 1, tk),
    )
    loops = ("t", "n", "k")
    xi = ("b", "t", "k") if batch_first else ("t", "b", "k")
    steps: list = [Load("xt", "x", xi, loops, multicast=pn > 1)]
    buffers = [Buffer("xt", ("t", "b", "k"), dtype, True)]
    for gi in range(g):
        steps += [
            Load(f"w{gi}", "w", ("n", "k"), loops, multicast=pt > 1, offsets=(gi * h, 0)),
            Matmul(f"a{gi}", "xt", f"w{gi}", loops),
        ]
        buffers += [
            Buffer(f"w{gi}", ("n", "k"), dtype, True),
            Buffer(f"a{gi}", xi[:2] + ("n",), _F32),
        ]
    for gi in range(g):
        if bias:
            steps += [
                Load(f"bias{gi}", "bias", (None, "n"), loops[:2], offsets=(gi, 0)),
                Vector("add", f"a{gi}", (f"a{gi}", f"bias{gi}"), (), loops[:2]),
            ]
            buffers.append(Buffer(f"bias{gi}", ("n",), dtype))
        steps.append(
            Store("out", f"a{gi}", ("t", None, "b", "n"), loops[:2], offsets=(0, gi, 0, 0))
        )
    lay = SpyreTensorLayout.default
    operands = [
        Operand("x", lay((b, t, i) if batch_first else (t, b, i), dtype), "input"),
        Operand("w", lay((g * h, i), dtype), "input"),
    ]
    if bias:
        operands.append(Operand("bias", lay((g, h), dtype), "input"))
    operands.append(Operand("out", lay((t, g, b, h), dtype), "output"))
    return Program(
        name=f"rnn_input_proj_{t}x{b}x{i}_g{g}x{h}",
        dims=dims,
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=loops,
    )


def best_input_projection(
    t: int,
    b: int,
    i: int,
    g: int,
    h: int,
    dtype: torch.dtype = torch.float16,
    *,
    bias: bool = True,
    batch_first: bool = False,
    config: HardwareConfig | None = None,
) -> Program:
    """The input projection the timing model finds fastest (core splits over
    time and hidden units, tiles that fit the LX)."""
    cfg = config or HardwareConfig()
    key = ("rnn_input_proj", t, b, i, g, h, dtype, bias, batch_first, cfg)

    def run() -> Program:
        se = stick_elems(dtype)
        cands = []
        for pt, pn in itertools.product(_pows(cfg.cores, t), stick_splits(ceil_div(h, se), 32)):
            if pt * pn > cfg.cores:
                continue
            et = ceil_div(t, pt)
            en = ceil_div(ceil_div(h, se), pn) * se if pn > 1 else h
            for tt, tn, tk in sorted(
                {(et, en, i), (et, en, min(i, 256)), (ceil_div(et, 4), en, i)}
            ):
                cands.append(((pt, pn), (tt, tn, tk)))

        def build(c):
            return input_projection(
                t, b, i, g, h, dtype, bias=bias, batch_first=batch_first,
                split=c[0], tiles=c[1], config=cfg,
            )  # fmt: skip

        return search(cands, build, cfg, f"RNN input projection {t}x{b}x{i}->{g}x{h}").result

    return _memo.get(key, run, remember=(ProgramError,))


def recurrent_step(
    mode: str,
    b: int,
    h: int,
    k: int,
    t_steps: int,
    t: int,
    dtype: torch.dtype = torch.float16,
    *,
    reverse: bool = False,
    proj: bool = False,
    masked: bool = False,
    split: tuple[int, int] = (1, 1),
    tile_n: int | None = None,
    config: HardwareConfig | None = None,
) -> Program:
    """Timestep ``t`` of a layer direction (see the module doc).

    Operands: ``xp`` [T, G, B, H] (the input projection), ``hs`` [T + 1, B, K]
    (inout: the states; ``K`` is ``H``, or the projection size with ``proj``),
    ``w`` [G*H, K] (``weight_hh``), ``c`` [B, H] (LSTM, inout), ``bhn`` [H]
    (GRU: the hidden bias of the new gate, inside ``r * (...)``), ``wr``
    [K, H] (``proj``), ``mask`` [T, B, 1] (``masked``: 1 where row b is inside
    its sequence at step t).  ``split``: cores over (B, H)."""
    g = GATES[mode]
    if proj and mode != "lstm":
        raise ProgramError("recurrent_step: a projection is an LSTM option")
    if not proj and k != h:
        raise ProgramError("recurrent_step: without a projection the state has H elements")
    pb, pn = split
    se = stick_elems(dtype)
    en = ceil_div(ceil_div(h, se), pn) * se if pn > 1 else h
    pn = ceil_div(h, en)
    eb = ceil_div(b, pb)
    dims = [Dim("b", b, pb, eb), Dim("n", h, pn, tile_n or en, chunk=en if pn > 1 else None)]
    dims.append(Dim("k", k))  # the state: whole on every core (each step reads all of it)
    row_in, row_out = (t + 1, t) if reverse else (t, t + 1)
    lb, ln = ("b",), ("b", "n")
    steps: list = [Load("ht", "hs", (None, "b", "k"), lb, multicast=pn > 1, offsets=(row_in, 0, 0))]
    buffers = [Buffer("ht", ("b", "k"), dtype)]
    if masked:
        steps.append(Load("mt", "mask", (None, "b", None), lb, offsets=(t, 0, 0)))
        buffers.append(Buffer("mt", ("b",), dtype))
    for gi in range(g):
        steps += [
            Load(f"w{gi}", "w", ("n", "k"), ln, multicast=pb > 1, offsets=(gi * h, 0)),
            Matmul(f"a{gi}", "ht", f"w{gi}", ln),
            Load(f"x{gi}", "xp", (None, None, "b", "n"), ln, offsets=(t, gi, 0, 0)),
        ]
        buffers += [
            # several hidden tiles per core: the next weight tile streams in
            # while this one is used
            Buffer(f"w{gi}", ("n", "k"), dtype, (tile_n or en) < en),
            Buffer(f"a{gi}", ("b", "n"), _F32),
            Buffer(f"x{gi}", ("b", "n"), dtype),
        ]
    need_hp = mode == "gru" or (masked and not proj)
    if need_hp:  # the previous state by hidden unit (GRU's blend, a mask's)
        steps.append(Load("hp", "hs", (None, "b", "n"), ln, offsets=(row_in, 0, 0)))
        buffers.append(Buffer("hp", ("b", "n"), dtype))

    def blend(new: str, old: str, loops) -> None:  # new = old + m * (new - old)
        steps.extend(
            [
                Vector("sub", new, (new, old), (), loops),
                Vector("mul", new, (new, "mt"), (), loops),
                Vector("add", new, (new, old), (), loops),
            ]
        )

    def add(out: str, a: str, c: str) -> None:
        steps.append(Vector("add", out, (a, c), (), ln))

    def act(op: str, x: str) -> None:
        steps.append(Vector(op, x, (x,), (), ln))

    if mode == "lstm":
        for gi, fn in enumerate(("sigmoid", "sigmoid", "tanh", "sigmoid")):
            add(f"a{gi}", f"a{gi}", f"x{gi}")
            act(fn, f"a{gi}")
        steps += [
            Load("ct", "c", ("b", "n"), ln),
            Vector("mul", "a1", ("a1", "ct"), (), ln),  # f * c
            Vector("mul", "a0", ("a0", "a2"), (), ln),  # i * g
            Vector("add", "cn", ("a1", "a0"), (), ln),
            Vector("tanh", "a2", ("cn",), (), ln),
            Vector("mul", "a3", ("a3", "a2"), (), ln),  # h = o * tanh(c)
        ]
        buffers += [Buffer("ct", ("b", "n"), _F32), Buffer("cn", ("b", "n"), _F32)]
        if masked:
            blend("cn", "ct", ln)
        steps.append(Store("c", "cn", ("b", "n"), ln))
        hn = "a3"
    elif mode == "gru":
        add("a0", "a0", "x0")
        act("sigmoid", "a0")  # r
        add("a1", "a1", "x1")
        act("sigmoid", "a1")  # z
        steps += [
            Load("bn", "bhn", ("n",), ln),
            Vector("add", "a2", ("a2", "bn"), (), ln),
            Vector("mul", "a2", ("a2", "a0"), (), ln),  # r * (W_hn h + b_hn)
            Vector("add", "a2", ("a2", "x2"), (), ln),
            Vector("tanh", "a2", ("a2",), (), ln),  # n
            Vector("sub", "a0", ("hp", "a2"), (), ln),
            Vector("mul", "a0", ("a0", "a1"), (), ln),
            Vector("add", "a2", ("a2", "a0"), (), ln),  # n + z * (h - n)
        ]
        buffers.append(Buffer("bn", ("n",), dtype))
        hn = "a2"
    else:
        add("a0", "a0", "x0")
        act("tanh" if mode == "rnn_tanh" else "relu", "a0")
        hn = "a0"
    if proj:
        steps += [Load("wr", "wr", ("k", "n"), ln, multicast=pb > 1), Matmul("hr", hn, "wr", ln)]
        buffers += [Buffer("wr", ("k", "n"), dtype), Buffer("hr", ("b", "k"), _F32)]
        if pn > 1:
            steps.append(RingAllReduce("hr", "n", "sum", lb))
        if masked:
            blend("hr", "ht", lb)
        steps.append(Store("hs", "hr", (None, "b", "k"), lb, offsets=(row_out, 0, 0)))
    else:
        if masked:
            blend(hn, "hp", ln)
        steps.append(Store("hs", hn, (None, "b", "n"), ln, offsets=(row_out, 0, 0)))
    lay = SpyreTensorLayout.default
    operands = [
        Operand("xp", lay((t_steps, g, b, h), dtype), "input"),
        Operand("hs", lay((t_steps + 1, b, k), dtype), "inout"),
        Operand("w", lay((g * h, k), dtype), "input"),
    ]
    if mode == "lstm":
        operands.append(Operand("c", lay((b, h), dtype), "inout"))
    if mode == "gru":
        operands.append(Operand("bhn", lay((h,), dtype), "input"))
    if proj:
        operands.append(Operand("wr", lay((k, h), dtype), "input"))
    if masked:
        operands.append(Operand("mask", lay((t_steps, b, 1), dtype), "input"))
    return Program(
        name=f"{mode}_step_{b}x{h}" + (f"p{k}" if proj else "") + f"_t{t}of{t_steps}"
        + ("_rev" if reverse else "") + ("_masked" if masked else ""),
        dims=tuple(dims),
        operands=tuple(operands),
        buffers=tuple(buffers),
        steps=tuple(steps),
        loop_order=ln,
    )  # fmt: skip


def best_step_plan(
    mode: str,
    b: int,
    h: int,
    k: int,
    dtype: torch.dtype = torch.float16,
    *,
    proj: bool = False,
    masked: bool = False,
    config: HardwareConfig | None = None,
) -> tuple[tuple[int, int], int | None]:
    """The (split, tile_n) of a timestep the timing model finds fastest.

    Planned once on step 0 of a two-step sequence: the steps of a sequence
    differ only in the rows they address, not in their work."""
    cfg = config or HardwareConfig()
    key = ("rnn_step_plan", mode, b, h, k, dtype, proj, masked, cfg)

    def run():
        se = stick_elems(dtype)
        sticks = ceil_div(h, se)
        cands = []
        for pb, pn in itertools.product(_pows(cfg.cores, b), stick_splits(sticks, cfg.cores)):
            if pb * pn > cfg.cores:
                continue
            en = ceil_div(sticks, pn) * se if pn > 1 else h
            for tn in sorted({en, min(en, 4 * se), min(en, se)}):
                cands.append(((pb, pn), tn))

        def build(c):
            return recurrent_step(
                mode, b, h, k, 2, 0, dtype, proj=proj, masked=masked, split=c[0],
                tile_n=c[1], config=cfg,
            )  # fmt: skip

        return search(cands, build, cfg, f"{mode} step {b}x{h}").candidate

    return _memo.get(key, run, remember=(ProgramError,))
