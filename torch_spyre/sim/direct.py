"""Matmuls that read their weight in place, in its stick layout.

The functional executor computes on host-layout tensors; a weight converted
to a contiguous fp32 host tensor costs a re-lay and a cast on every read, or,
kept (``hostviews``), twice the weight's device bytes of host memory.  A
matmul whose one operand is a model input loaded whole (a weight: an
``input`` operand read only by this matmul) instead reads that operand's
device memory through a strided ``[N, K / S, S]`` view (S elements per
stick) with ``_card.stick_gemm``: fp16 / bf16 / fp32 (or, on a DL16 card,
DL16: ``TORCH_SPYRE_FP16_FORMAT``) products fused into fp32 accumulators, as
the PE array accumulates.  The summation order is the
kernel's own, fixed one (csrc/card/gemm.cpp), not the host BLAS's: the sums are
fp32 sums of the same products, so the results differ from a host GEMM's in
the last bits of the fp32 accumulator, and the card's own order is not
modelled either (docs/hardware-model.md, "Accumulation order").

Which matmuls qualify is decided when a program's runner is built (the
operand's layout and the program's dims are known then); the others keep
the einsum of ``executor._build_matmul``.  ``TORCH_SPYRE_STICK_GEMM=0``
(or :func:`set_enabled`) turns the path off: every matmul takes the einsum,
with the weight converted (and kept by ``hostviews``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_spyre import _card, dl16, settings
from torch_spyre.ir import Load, Matmul, Program, sole_load

_P = "@"  # the executor's prefix of a per-core partial axis
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: up to this many rows of the other operand the kernel is faster than a host
#: GEMM after a re-lay and cast of the weight (``benchmarks/stick_gemm.py``,
#: kernel / re-lay + GEMM at 16 rows: 0.86 for 1536x576, 0.61 for 576x1536,
#: 0.23 for 5632x2048; at 32 rows 1536x576 loses, 1.13), and it keeps no host
#: copy of the weight: vLLM's batch-16 decode bucket reads weights in place
#: (``benchmarks/gemv_rows.py``: 0.83x the CPU time of a threshold of 8)
GEMV_ROWS = 16

Buffers = dict[str, torch.Tensor]


def enabled() -> bool:
    """The ``stick_gemm`` setting (``TORCH_SPYRE_STICK_GEMM``)."""
    return settings.get().stick_gemm


def set_enabled(on: bool) -> bool:
    """Turn the in-place weight reads on or off (the executor rebuilds a
    program's runner built the other way on its next use).  Returns the
    previous setting."""
    prev = settings.get().stick_gemm
    settings.update(stick_gemm=bool(on))
    return prev


@dataclass(frozen=True)
class Plan:
    """A matmul step that reads its weight in place."""

    load: int  # the weight's Load step
    weight: str  # the weight's buffer name
    act: str  # the other operand's buffer name
    n_dim: str
    k_dims: tuple[str, ...]
    #: the weight as a strided view of its device memory: size, stride, offset
    view: tuple[tuple[int, int, int], tuple[int, int, int], int]
    k: int
    chunk: int
    parts: int
    #: the weight's memory holds DL16 bits (read as int16: the kernel decodes them)
    dl16: bool = False


def plan(program: Program) -> dict[int, Plan]:
    """{matmul step index: plan} for the matmuls of ``program`` that qualify."""
    if not enabled():
        return {}
    steps = program.steps
    out: dict[int, Plan] = {}
    for m, st in enumerate(steps):
        if not isinstance(st, Matmul) or st.a == st.b:
            continue
        for weight, act in ((st.b, st.a), (st.a, st.b)):
            p = _plan_one(program, m, st, weight, act)
            if p is not None:
                out[m] = p
                break
    return out


def _plan_one(program: Program, m: int, st: Matmul, weight: str, act: str) -> Plan | None:
    # the weight's buffer is loaded for this matmul only
    w = sole_load(program.steps, m, weight)
    if w is None:
        return None
    ld: Load = program.steps[w]
    op = program.operand(ld.operand)
    lay = op.layout
    if (
        op.role != "input"
        or lay.dtype not in _WEIGHT_DTYPES
        or len(lay.host_size) < 2
        or None in ld.index
    ):
        return None
    out_dims = program.buffer(st.out).dims
    host_dims = tuple(ld.index)
    n_dim, k_dims = host_dims[0], host_dims[1:]
    if n_dim not in out_dims or any(d in out_dims for d in k_dims):
        return None
    if program.buffer(ld.buffer).dims and set(program.buffer(ld.buffer).dims) != set(host_dims):
        return None
    act_dims = set(program.buffer(act).dims)
    if not set(k_dims) <= act_dims or n_dim in act_dims:
        return None
    if not program.buffer(act).dtype.is_floating_point:
        return None
    m_dims = [d for d in program.buffer(act).dims if d not in k_dims]
    if set(out_dims) != set(m_dims) | {n_dim}:
        return None
    # sub-blocks: rows of the weight only (two halves of a merged weight)
    offs = ld.offsets or (0,) * len(host_dims)
    sizes = [program.dim(d).size for d in host_dims]
    if any(o or s != h for o, s, h in zip(offs[1:], sizes[1:], lay.host_size[1:])):
        return None
    split = [d for d in k_dims if program.dim(d).cores > 1]
    if len(split) > 1 or (split and split[0] != k_dims[0]):
        return None
    inner = math.prod(sizes[1:]) // sizes[1]
    k = math.prod(sizes[1:])
    if split:
        dd = program.dim(split[0])
        chunk, parts = dd.core_extent * inner, dd.cores
    else:
        chunk, parts = max(k, 1), 1
    view = _weight_view(lay, offs[0], sizes[0])
    if view is None or (len(k_dims) > 1 and lay.padded):
        return None
    return Plan(w, weight, act, n_dim, tuple(k_dims), view, k, chunk, parts, lay.dl16)


def _weight_view(lay, row0: int, rows: int):
    """(size, stride, offset) of rows ``row0 .. row0 + rows`` of the operand as
    ``[rows, sticks, stick]`` over its device memory, or None."""
    padded, split_sizes, _, synthetic = lay._plan
    if padded[0] != lay.host_size[0]:
        return None
    meta = torch.empty(lay.device_size, dtype=lay.dtype, device="meta")
    x = meta.permute(lay._inverse_perm)
    if any(lay.device_size[d] != 1 for d in synthetic):
        return None
    x = x.reshape(split_sizes)  # synthetic dims are size 1: still a view
    if x.shape[0] != lay.host_size[0] or x.stride(-1) != 1:
        return None
    try:
        x = x.view(x.shape[0], -1, x.shape[-1])
    except RuntimeError:
        return None
    x = x.narrow(0, row0, rows)
    return tuple(x.shape), tuple(x.stride()), x.storage_offset()


def build_load(program: Program, s: Load, dims: dict, p: Plan) -> Callable:
    """The weight's load: a strided view of its device memory, no copy."""
    size, stride, offset = p.view
    operand, out, bits = s.operand, s.buffer, p.dl16
    dims[out] = (p.n_dim, *p.k_dims)

    def load(buffers: Buffers, env: dict) -> None:
        mem = buffers[operand]
        if bits:
            mem = mem.view(torch.int16)
        env[out] = mem.as_strided(size, stride, mem.storage_offset() + offset)

    return load


def build_matmul(program: Program, s: Matmul, dims: dict, p: Plan, to_res) -> Callable:
    act_dims = dims[p.act]
    m_dims = tuple(d for d in act_dims if d not in p.k_dims)
    order = [act_dims.index(d) for d in m_dims + p.k_dims]
    a_perm = None if order == list(range(len(order))) else tuple(order)
    m_sizes = [program.dim(d).size for d in m_dims]
    rows = math.prod(m_sizes)
    out_buf = program.buffer(s.out)
    partial = (_P + p.k_dims[0],) if p.parts > 1 else ()
    res_dims = partial + m_dims + (p.n_dim,)
    out_dims = partial + out_buf.dims
    perm = [res_dims.index(d) for d in out_dims]
    r_perm = None if perm == list(range(len(perm))) else tuple(perm)
    shape = [p.parts] * bool(partial) + m_sizes + [program.dim(p.n_dim).size]
    act, weight, out, k, chunk, parts = p.act, p.weight, s.out, p.k, p.chunk, p.parts
    f32 = torch.float32
    dims[out] = out_dims

    def matmul(buffers: Buffers, env: dict) -> None:
        a = env[act]
        if a_perm is not None:
            a = a.permute(a_perm)
        a = a.reshape(rows, k).to(f32)
        w = env[weight]
        if rows <= GEMV_ROWS:
            if a.stride(-1) != 1:
                a = a.contiguous()
            r = _card.stick_gemm(a, w, k, chunk, parts).view(shape)
        else:
            r = _host_gemm(a, w, k, chunk, parts).view(shape)
        if r_perm is not None:
            r = r.permute(r_perm)
        env[out] = to_res(r)

    return matmul


#: rows of a weight re-laid at a time by the host-GEMM path (bounds the
#: transient host copy, e.g. of a 49152-row LM head, to ~8 MB)
_BLOCK_BYTES = 8 << 20


def _host_gemm(a: torch.Tensor, w: torch.Tensor, k: int, chunk: int, parts: int) -> torch.Tensor:
    """Many rows of ``a``: host GEMMs on the weight re-laid and cast for this
    call, a block of its rows at a time (not kept: the conversion is small
    against the GEMM).  fp32 [parts, rows, N]."""
    n, rows = w.shape[0], a.shape[0]
    step = max(1, _BLOCK_BYTES // max(4 * k, 1))
    if parts > 1:
        pad = (0, chunk * parts - k)
        a = torch.nn.functional.pad(a, pad).view(rows, parts, chunk)
    out = []
    for n0 in range(0, n, step):
        wb = w[n0 : n0 + step].reshape(min(step, n - n0), -1)[:, :k]
        wb = dl16.decode(wb) if wb.dtype == torch.int16 else wb.to(torch.float32)
        if parts == 1:
            out.append(torch.mm(a, wb.t()))
        else:
            wb = torch.nn.functional.pad(wb, pad).view(-1, parts, chunk)
            out.append(torch.einsum("mpc,npc->pmn", a, wb))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)
