"""Rewrites of a fused group's step list before it is planned.

What each step reads and writes (``_reads`` / ``_writes``), dead-step
removal (``_live``), renaming of dims to canonical names (``_rename_step``)
and LX buffer reuse by liveness (``_reuse_buffers``); then the row
rewrites: whether rows longer than the LX can be streamed in one pass
(``_stream_rows``), and the multi-pass form of a row kernel whose row steps
use a reduction's result (``_multipass``), with softmax's max and sum in
one pass (``_online_softmax``) and a norm's variance summed with its mean
(``_one_pass_variance``).  Pure functions of steps and buffers: the
planner (``kernels.plan``) calls them.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

# registers the vector ops these rewrites emit (logsumexp, maximum_scalar)
from torch_spyre.ir import Buffer, Load, Matmul, Reduce, Store, Vector


def _rename_step(s, ren: dict[str, str]):
    if isinstance(s, Load | Store):
        return replace(s, index=tuple(ren[d] if d is not None else None for d in s.index))
    if isinstance(s, Reduce):
        return replace(s, dim=ren[s.dim])
    return s


def _reads(s) -> tuple[str, ...]:
    if isinstance(s, Store):
        return (s.buffer,)
    if isinstance(s, Vector):
        return s.inputs
    if isinstance(s, Reduce):
        return (s.input,)
    if isinstance(s, Matmul):
        return (s.a, s.b)
    return ()


def _writes(s) -> str | None:
    if isinstance(s, Load):
        return s.buffer
    if isinstance(s, Vector | Reduce | Matmul):
        return s.out
    return None


def _live(steps):
    """The steps whose results are used (a store, or read by a later live
    step): an index computed only to address a load (``indirect_indexing``
    of an iota) leaves dead vector steps behind, and the multi-pass rewrites
    (``_online_softmax``, ``_one_pass_variance``) leave the steps they
    replaced."""
    needed: set[str] = set()
    out = []
    for s in reversed(steps):
        w = _writes(s)
        if isinstance(s, Store) or w is None or w in needed:
            out.append(s)
            needed.update(_reads(s))
    return out[::-1]


def _reuse_buffers(steps, buffers: dict[str, Buffer]):
    """LX planning inside the kernel: a buffer whose value is dead is reused by
    the next value of the same dims and dtype (vector ops may work in place)."""
    last: dict[str, int] = {}
    for i, s in enumerate(steps):
        for r in _reads(s):
            last[r] = i
    free: dict[tuple, list[str]] = {}
    alias: dict[str, str] = {}
    out_steps = []
    for i, s in enumerate(steps):
        w = _writes(s)
        reads = [alias.get(r, r) for r in _reads(s)]
        if isinstance(s, Store):
            s = replace(s, buffer=reads[0])
        elif isinstance(s, Vector):
            s = replace(s, inputs=tuple(reads))
        elif isinstance(s, Reduce):
            s = replace(s, input=reads[0])
        elif isinstance(s, Matmul):
            s = replace(s, a=reads[0], b=reads[1])
        # release the inputs that die here (before allocating the output: in place)
        if not isinstance(s, Reduce | Matmul):
            _release(s, i, last, alias, buffers, free, steps)
        if w is not None:
            b = buffers[w]
            key = (b.dims, b.dtype, b.double_buffered)
            if not b.double_buffered and free.get(key):
                alias[w] = free[key].pop()
            else:
                alias[w] = w
            if isinstance(s, Load):
                s = replace(s, buffer=alias[w])
            elif isinstance(s, Vector | Reduce | Matmul):
                s = replace(s, out=alias[w])
        if isinstance(s, Reduce | Matmul):
            _release(s, i, last, alias, buffers, free, steps)
        out_steps.append(s)
    used = {x for s in out_steps for x in (*_reads(s), _writes(s)) if x}
    return out_steps, {n: b for n, b in buffers.items() if n in used}


def _release(s, i, last, alias, buffers, free, steps) -> None:
    for orig, at in list(last.items()):
        if at == i:
            phys = alias.get(orig, orig)
            b = buffers[phys]
            if not b.double_buffered:
                free.setdefault((b.dims, b.dtype, b.double_buffered), []).append(phys)
            del last[orig]


def _stream_rows(steps, buffers, reduced) -> set[int] | None:
    """The steps that work on row data (buffers with a reduced dim) when the
    rows can be streamed: no row step uses a reduction's result (softmax and
    layer norm need the whole row twice).  None when they cannot."""
    derived: set[str] = set()
    partial: set[str] = set()
    row: set[int] = set()
    for i, s in enumerate(steps):
        touched = [*_reads(s), *([_writes(s)] if _writes(s) else [])]
        on_row = any(set(buffers[b].dims) & reduced for b in touched) or (
            isinstance(s, Load | Store) and set(s.index) & reduced
        )
        if on_row:
            # a reduction of a partial reduction (several reduced dims) may stream
            if any(
                r in derived and not (isinstance(s, Reduce) and r in partial) for r in _reads(s)
            ):
                return None
            row.add(i)
        if isinstance(s, Reduce) or any(r in derived for r in _reads(s)):
            if _writes(s):
                derived.add(_writes(s))
                if isinstance(s, Reduce) and set(buffers[s.out].dims) & reduced:
                    partial.add(s.out)
    return row


def _readers(steps) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        for r in _reads(s):
            out.setdefault(r, []).append(i)
    return out


def _producers(steps, buffers, reduced):
    """For matching patterns in a group's steps: (step index by the buffer it
    writes, whether a buffer holds row values, the producer of a buffer if it
    is a ``cls`` step with op ``op``)."""
    prod = {_writes(s): i for i, s in enumerate(steps) if _writes(s)}

    def row(b):
        return bool(set(buffers[b].dims) & reduced)

    def step(b, cls, op=None):
        st = steps[prod[b]] if b in prod else None
        return st if isinstance(st, cls) and (op is None or st.op == op) else None

    return prod, row, step


def _online_softmax(steps, buffers, reduced):
    """Softmax's max and sum in one pass over the row: ``m = max(x)``,
    ``s = sum(exp(x - m))`` become ``m = logsumexp(x)`` (an online max and
    sum, rescaled per tile) and ``s = 1``, so ``exp(x - m) / s`` and
    ``x - m - log(s)`` (log-softmax) keep their values while the row is read
    twice instead of three times.  Only when every reader of m, s, x - m and
    exp(x - m) is one of those expressions."""
    steps, buffers = list(steps), dict(buffers)
    prod, row, step = _producers(steps, buffers, reduced)

    for i, s in enumerate(list(steps)):
        if not (isinstance(s, Reduce) and s.op == "sum" and row(s.input) and not row(s.out)):
            continue
        pe = step(s.input, Vector, "exp")
        pd = pe and step(pe.inputs[0], Vector, "sub")
        pm = pd and step(pd.inputs[1], Reduce, "max")
        if not (pm and pm.dim == s.dim and pm.input == pd.inputs[0] and not row(pm.out)):
            continue
        rd = _readers(steps)
        e, d, m, tot = s.input, pd.out, pm.out, s.out
        ok = rd.get(m) == [prod[d]]
        for j in rd.get(tot, []):
            t = steps[j]
            if isinstance(t, Vector) and t.op == "reciprocal":
                ok &= all(
                    isinstance(steps[k], Vector) and steps[k].op == "mul" and e in steps[k].inputs
                    for k in rd.get(t.out, [])
                )
            elif isinstance(t, Vector) and t.op == "log":
                ok &= all(
                    isinstance(steps[k], Vector) and steps[k].op == "sub"
                    and steps[k].inputs == (d, t.out)
                    for k in rd.get(t.out, [])
                )  # fmt: skip
            elif isinstance(t, Vector) and t.op == "div":
                ok &= t.inputs == (e, tot)
            else:
                ok = False
        for j in rd.get(e, []):
            t = steps[j]
            ok &= j == i or (isinstance(t, Vector) and t.op in ("mul", "div"))
        for j in rd.get(d, []):
            t = steps[j]
            ok &= j == prod[e] or (isinstance(t, Vector) and t.op == "sub" and t.inputs[0] == d)
        if not ok:
            continue
        one = f"{tot}_0"
        buffers[one] = replace(buffers[tot], name=one, double_buffered=False)
        steps[prod[m]] = Reduce("logsumexp", m, pm.input, pm.dim)
        steps[i] = [
            Vector("mul_scalar", one, (m,), (0.0,)),
            Vector("add_scalar", tot, (one,), (1.0,)),
        ]
        steps = [x for st in steps for x in (st if isinstance(st, list) else [st])]
        prod, row, step = _producers(steps, buffers, reduced)
    return steps, buffers


def _one_pass_variance(steps, buffers, reduced):
    """A norm's ``m2 = sum((x - sum(x) / n)^2)`` (two passes over the row) as
    ``sum(x^2) - sum(x) * mean`` (clamped at 0), summed in the same pass as
    ``sum(x)``: a layer norm reads its row twice (statistics, normalise)."""
    steps, buffers = list(steps), dict(buffers)
    prod, row, step = _producers(steps, buffers, reduced)

    for i, s in enumerate(list(steps)):
        if not (isinstance(s, Reduce) and s.op == "sum" and row(s.input) and not row(s.out)):
            continue
        psq = step(s.input, Vector, "square")
        pxc = psq and step(psq.inputs[0], Vector, "sub")
        pmean = pxc and step(pxc.inputs[1], Vector, "mul_scalar")
        ps = pmean and step(pmean.inputs[0], Reduce, "sum")
        if not (ps and ps.dim == s.dim and ps.input == pxc.inputs[0] and not row(ps.out)):
            continue
        x, mean, tot, m2 = ps.input, pmean.out, ps.out, s.out
        new = {f"{m2}_{k}": b for k, b in (("x2", x), ("q", m2), ("t", m2), ("r", m2))}
        for n, like in new.items():
            buffers[n] = replace(buffers[like], name=n, dtype=torch.float32, double_buffered=False)
        x2, q, t, r = new
        steps[i] = [
            Vector("square", x2, (x,)),
            Reduce("sum", q, x2, s.dim),
            Vector("mul", t, (tot, mean)),
            Vector("sub", r, (q, t)),
            Vector("maximum_scalar", m2, (r,), (0.0,)),
        ]
        steps = [x for st in steps for x in (st if isinstance(st, list) else [st])]
        prod, row, step = _producers(steps, buffers, reduced)
    return steps, buffers


@functools.lru_cache(maxsize=256)
def _multipass(steps, buffer_items, reduced: frozenset):
    """A fused row kernel whose rows do not fit the LX and whose row steps
    use a reduction's result (softmax, layer / RMS norm) as several passes
    over the row, each walking the row in tiles and re-reading it from
    device memory: pass p computes the reductions that depend on p earlier
    ones (recomputing the row values it needs from the loads), the per-row
    results are combined between passes.  Softmax's max and sum share one
    pass (``_online_softmax``), as do a norm's sum and sum of squares
    (``_one_pass_variance``), so softmax and norms read their row twice.

    ``steps`` are the group's steps before LX reuse (every buffer written
    once).  Returns (steps, buffers, indices of the row steps) or None."""
    steps, buffers = list(steps), dict(buffer_items)
    writes = [_writes(s) for s in steps if _writes(s)]
    if len(writes) != len(set(writes)) or any(isinstance(s, Matmul) for s in steps):
        return None
    steps, buffers = _online_softmax(steps, buffers, reduced)
    steps, buffers = _one_pass_variance(steps, buffers, reduced)
    steps = _live(steps)

    def is_row(s) -> bool:
        touched = [*_reads(s), *([_writes(s)] if _writes(s) else [])]
        return any(set(buffers[b].dims) & reduced for b in touched) or (
            isinstance(s, Load | Store) and bool(set(s.index) & reduced)
        )

    def is_row_buf(b) -> bool:
        return bool(set(buffers[b].dims) & reduced)

    prod = {_writes(s): i for i, s in enumerate(steps) if _writes(s)}
    level: dict[str, int] = {}
    where: list[int] = []  # the pass (or the section before it) of each step
    for s in steps:
        lv = max((level[r] for r in _reads(s)), default=0)
        where.append(lv)
        w = _writes(s)
        if w is not None:
            ends = isinstance(s, Reduce) and not set(buffers[w].dims) & reduced
            level[w] = lv + 1 if ends and is_row(s) else lv
    row = [is_row(s) for s in steps]
    passes = max((where[i] for i in range(len(steps)) if row[i]), default=0)
    if passes == 0:
        return None  # one pass: ``_stream_rows`` handles it
    out: list = []
    out_row: list[int] = []
    for p in range(max(where) + 1):
        out.extend(s for i, s in enumerate(steps) if not row[i] and where[i] == p)
        # seeds: the reductions that end in this pass and its stores; the
        # row steps they read join it (recomputed if an earlier pass had them)
        need = {
            i
            for i, s in enumerate(steps)
            if row[i] and where[i] == p
            and (isinstance(s, Store) or (isinstance(s, Reduce) and not is_row_buf(s.out)))
        }  # fmt: skip
        todo = list(need)
        while todo:  # recompute the row values this pass reads
            for r in _reads(steps[todo.pop()]):
                j = prod[r]
                if row[j] and is_row_buf(r) and j not in need:
                    need.add(j)
                    todo.append(j)
        for i in sorted(need):
            out_row.append(len(out))
            out.append(steps[i])
    steps, buffers = _reuse_buffers(out, buffers)
    for st in steps:
        if isinstance(st, Store) and not buffers[st.buffer].double_buffered:
            buffers[st.buffer] = replace(buffers[st.buffer], double_buffered=True)
    return steps, buffers, set(out_row)
