"""The core split, tiles and loop order of a fused kernel, chosen by cost.

``_plan_dims`` (memoised on the kernel's structure) runs ``_search_plan``:
the stick-aware split of the non-reduced dims over cores, candidate splits
of a matmul kernel (``_matmul_choices``, ``_matmul_split``: batch, rows,
columns and k over cores, multicast of shared tiles) or pipelined tiles of
a row kernel (``_pipelined_tiles``), each fitted to the LX budget by
shrinking tiles (``_fit``, ``_lx_total``; rows streamed or re-planned as
several passes, ``_balance_row_tiles``), and the cheapest by the timing
model kept (``kernels/search.py``).  The compiler plans its fused groups
with it (``compiler/lowering.py``, ``compiler/layouts.py``); ``replan``
gives an eager program the same search.
"""

from __future__ import annotations

import math
from dataclasses import replace

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import (
    Dim,
    Load,
    Matmul,
    Operand,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    Scan,
    Store,
    Vector,
    constants,
    step_reads,
    step_writes,
)
from torch_spyre.kernels.rewrites import _multipass, _stream_rows
from torch_spyre.kernels.search import Found, Memo, Search, Unsupported
from torch_spyre.kernels.splits import stick_splits
from torch_spyre.layout import ceil_div, stick_elems
from torch_spyre.sim import estimate


def _dkey(d: str) -> int:
    return int(d[1:])


def _matmul_split(
    mm, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, mn=None, lx_share: float = 0.5,
    whole_k: bool = False,
):  # fmt: skip
    """Core split, tiles and loops of a kernel built around one PE-array matmul:
    batch dims over cores first, then the output plane over ``mn`` = (pm, pn)
    cores (``n`` in whole sticks; default: ``kernels.basic.default_matmul_split``);
    ``k`` streamed through the LX in tiles (``default_matmul_tiles``).
    None when the shape is not (batch, rows, one n, k)."""
    from torch_spyre.kernels.basic import default_matmul_split, default_matmul_tiles

    a, b, o = (set(buffers[x].dims) for x in (mm.a, mm.b, mm.out))
    kd = sorted((a & b) - o, key=_dkey)
    batch = sorted(a & b & o, key=_dkey)
    rows = sorted((a & o) - b, key=_dkey)
    cols = sorted((b & o) - a, key=_dkey)
    if len(cols) != 1 or not kd:
        return None
    (nd,) = cols
    # dims an epilogue reduces (a softmax over n) stay whole on each core
    held = {s.dim for s in steps if isinstance(s, Reduce)}
    dtype = buffers[mm.a].dtype
    se = stick_elems(dtype)
    m = math.prod(sizes[d] for d in rows) if rows else 1
    n, k = sizes[nd], math.prod(sizes[d] for d in kd)
    split: dict[str, tuple[int, int | None]] = {}
    used = 1
    for d in batch:
        c = max(1, min(sizes[d], cfg.cores // used))
        while (cfg.cores // used) % c:
            c -= 1
        if c > 1:
            split[d] = (c, None)
        used *= c
    rest = cfg.cores // used
    pk = 1
    if mn is not None:
        pm, pn = min(mn[0], rest, m), min(mn[1], max(1, rest // max(mn[0], 1)))
        pk = mn[2] if len(mn) > 2 and len(kd) == 1 else 1
    else:
        pm, pn = default_matmul_split(m, n, k, cfg.replace(cores=rest))[:2] if rest > 1 else (1, 1)
    if nd in held:
        pm, pn = min(rest, m) if mn is None else pm, 1
    row_split = next((d for d in rows if sizes[d] >= pm and d not in held), None)
    if mn is not None and len(mn) > 3:
        # a candidate that splits another row dim (_matmul_choices)
        row_split = rows[mn[3]]
    if row_split is not None and pm > 1:
        split[row_split] = (min(pm, sizes[row_split]), None)
    n_chunk = None
    if pn > 1:
        n_chunk = ceil_div(ceil_div(n, pn), se) * se
        pn = -(-n // n_chunk)
        if pn > 1:
            split[nd] = (pn, n_chunk)
        else:
            n_chunk = None
    em = m
    if row_split is not None and row_split in split:
        em = m // sizes[row_split] * -(-sizes[row_split] // split[row_split][0])
    en = n_chunk or n
    ek = k
    if pk > 1:
        # k over cores in whole sticks: per-core partial sums, combined by a
        # ring all-reduce of each output tile before the epilogue
        ek = ceil_div(ceil_div(k, pk), se) * se
        pk = -(-k // ek)
        if pk > 1:
            split[kd[0]] = (pk, ek)
            at = steps.index(mm) + 1
            steps = [*steps[:at], RingAllReduce(mm.out, kd[0], "sum"), *steps[at:]]
        else:
            ek = k
    # operand and accumulator tiles in ``lx_share`` of the LX (the rest for
    # the epilogue), so ``_fit`` need not shrink the rows
    if whole_k and (len(kd) != 1 or nd in held):
        return None
    tm, tn, tk = default_matmul_tiles(
        em, en, ek, dtype, True, cfg.replace(lx_bytes=int(cfg.lx_bytes * lx_share)), whole_k
    )
    tiles = {d: sizes[d] for d in sizes}
    for d in batch:
        tiles[d] = 1
    if rows:
        r0 = row_split or rows[0]
        i0 = rows.index(r0)
        inner = math.prod(sizes[d] for d in rows[i0 + 1 :])
        for d in rows[:i0]:
            tiles[d] = 1
        tiles[r0] = max(1, tm // max(inner, 1))
        if i0 > 0:
            # an inner row dim split: its core extent caps its tile, and the
            # rest of the row tile goes to the dims outside it (otherwise each
            # weight tile would serve one element of the outer dims at a time)
            ext = -(-sizes[r0] // split[r0][0]) if r0 in split else sizes[r0]
            tiles[r0] = min(tiles[r0], ext)
            left = tm // max(inner * tiles[r0], 1)
            for d in reversed(rows[:i0]):
                if left < 2:
                    break
                tiles[d] = min(sizes[d], left)
                left //= tiles[d]
    tiles[nd] = sizes[nd] if nd in held else tn
    inner_k = kd[-1]
    tiles[inner_k] = min(sizes[inner_k] if pk == 1 else ek, tk)
    for d in kd[:-1]:
        tiles[d] = 1 if tk < sizes[inner_k] else max(1, tk // sizes[inner_k])
    others = [d for d in sorted(sizes, key=_dkey) if d not in (*batch, *rows, nd, *kd)]
    loops = tuple(batch + rows + [nd] + [d for d in others if d not in reduced] + kd)
    steps = _prologue_first(steps, mm, set(kd), buffers)
    mm_bufs = {mm.a, mm.b}
    kset = set(kd)
    mm_steps = {
        i
        for i, s in enumerate(steps)
        if s is mm
        or (isinstance(s, Load) and s.buffer in mm_bufs)
        # a weight's prologue (its dequantisation): whatever works on k tiles
        or (isinstance(s, Load | Vector) and kset & set(buffers[step_writes(s)].dims))
    }
    return split, tiles, loops, mm_steps, steps


def _prologue_first(steps, mm, kd: set[str], buffers):
    """Steps before the matmul that do not work on k tiles (a weight scale's
    load) moved ahead of those that do, so the k loop is one loop."""
    at = steps.index(mm)
    before = steps[:at]

    def on_k(s) -> bool:
        w = step_writes(s)
        return w is not None and bool(kd & set(buffers[w].dims))

    outer = [s for s in before if not on_k(s)]
    if not outer or len(outer) == len(before):
        return steps
    # an outer step moves ahead of the k-tile steps before it: only when it
    # neither reads what they write (a k tile) nor writes what they read or
    # write (LX buffers are reused: a later fill may take the buffer an
    # earlier step still reads; fuzzer seed 800099, a wrong answer)
    seen_reads: set[str] = set()
    seen_writes: set[str] = set()
    for s in before:
        if s in outer:
            w = step_writes(s)
            if any(r in seen_writes for r in step_reads(s)) or w in seen_reads | seen_writes:
                return steps  # keep the program order
        else:
            seen_reads.update(step_reads(s))
            seen_writes.add(step_writes(s))
    inner = [s for s in before if s not in outer]
    return [*outer, *inner, *steps[at:]]


#: plans by kernel structure: a model's layers repeat the same kernels, and
#: the cost-model search over splits and tiles is the bulk of compile time
_PLANS = Memo(persist="plan")


def _plan_dims(
    name, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, naive: bool = False,
    streamed=None,
) -> Program:  # fmt: skip
    """``_search_plan``, memoised on everything it reads (the name aside)."""
    key = (
        tuple(steps),
        tuple(buffers.items()),
        tuple((u.name, u.role, u.layout) for u in ops),
        tuple(sorted(sizes.items())),
        frozenset(reduced),
        cfg,
        naive,
        streamed,
    )
    hit = _PLANS.get(
        key,
        lambda: _search_plan(name, steps, buffers, ops, sizes, reduced, cfg, naive, streamed),
        remember=(Unsupported,),
    )
    return hit if hit.name == name else replace(hit, name=name)


def _search_plan(
    name, steps, buffers, ops, sizes, reduced, cfg: HardwareConfig, naive: bool = False,
    streamed=None,
) -> Program:  # fmt: skip
    """Core split and tiles for the fused kernel, checked against the LX.

    A matmul kernel's split (and whether shared tiles are multicast), and a
    row kernel's tile, are chosen by the timing model among candidates;
    ``naive`` plans rows over cores with no operand reuse (for baselines)."""
    names = sorted(sizes, key=_dkey)
    loops = tuple(n for n in names if n not in reduced)
    # stick dims of stored operands: split over cores in whole sticks
    stick_of: dict[str, int] = {}
    for s in steps:
        if isinstance(s, Store | Load):
            lay = next(u.layout for u in ops if u.name == s.operand)
            d = s.index[lay.stick_dim] if lay.host_size else None
            if d is not None:
                stick_of[d] = max(stick_of.get(d, 1), stick_elems(lay.dtype))
    split: dict[str, tuple[int, int | None]] = {}
    remaining = cfg.cores
    cand = []
    for d in loops:
        se = stick_of.get(d)
        work = -(-sizes[d] // se) if se else sizes[d]
        cand.append((-work, se is not None, d))
    for _, _, d in sorted(cand):
        if remaining < 2:
            break
        se = stick_of.get(d)
        if se:
            sticks = -(-sizes[d] // se)
            n = min(remaining, sticks)
            if n < 2:
                continue
            chunk = -(-sticks // n) * se
            n = -(-sizes[d] // chunk)
            split[d] = (n, chunk if n > 1 else None)
        else:
            n = min(remaining, sizes[d])
            if n < 2:
                continue
            split[d] = (n, None)
        remaining //= n
    ext = {
        d: (split[d][1] or -(-sizes[d] // split[d][0])) if d in split else sizes[d] for d in names
    }
    tiles = {d: ext[d] for d in names}
    mm = next((s for s in steps if isinstance(s, Matmul)), None)
    # candidates: (split, tiles, loops, steps in the innermost loop, multicast)
    cands: list[tuple] = [(split, tiles, loops, set(), steps, False)]
    if mm is not None:
        mm_cands = []
        for mn, mc in _matmul_choices(mm, steps, buffers, sizes, cfg, naive):
            # tiles filling the whole LX (fewer operand re-reads) or half of it
            # (room for a large epilogue); naive: half
            for share, whole_k in ((0.5, False),) if naive else _TILINGS:
                planned = _matmul_split(
                    mm, steps, buffers, ops, sizes, reduced, cfg, mn, share, whole_k
                )
                if planned is None:
                    if whole_k:
                        continue
                    break
                mm_cands.append((*planned, mc))
        cands = mm_cands or cands
    elif not naive:
        cands += _pipelined_tiles(split, tiles, loops, steps, reduced, stick_of)

    def build(c: tuple) -> Program:
        split_, tiles_, loops_, mm_steps, steps_, mc = c
        return _fit(
            name, steps_, buffers, ops, sizes, reduced, cfg, names, stick_of,
            split_, dict(tiles_), loops_, mm_steps, mc, mm is not None, streamed,
        )  # fmt: skip

    # the cost model decides among the candidates (closed form, ~1 ms each);
    # naive: the first plan that fits
    found = Search(
        build, cfg, validate=False, first_fit=len(cands) == 1 or naive, rejected=(ProgramError,)
    )
    found.run(cands)
    if found.best is None:
        raise Unsupported(str(found.first_error)) from None
    return found.best.result


#: a matmul's tilings tried per core split: (share of the LX for operand and
#: accumulator tiles, activation-stationary whole-k tiles)
_TILINGS = ((1.0, False), (0.5, False), (1.0, True))


def _matmul_choices(mm, steps, buffers, sizes, cfg: HardwareConfig, naive: bool):
    """(pm, pn, pk) core splits of a matmul's rows, columns and contraction, and
    whether tiles shared by a group of cores are read once and multicast over
    the ring.

    Naive: rows over the cores, no operand reuse.  Otherwise every split of
    the cores left after the batch dims (powers of two, fewer cores included:
    a small matmul loses more to replicated operand traffic than it gains; k
    split over cores adds a ring all-reduce of each output tile), with and
    without multicast; the cost model picks (``_plan_dims``)."""
    a, b, o = (set(buffers[x].dims) for x in (mm.a, mm.b, mm.out))
    batch = sorted(a & b & o, key=_dkey)
    rows = sorted((a & o) - b, key=_dkey)
    cols = sorted((b & o) - a, key=_dkey)
    m = math.prod(sizes[d] for d in rows) if rows else 1
    used = 1
    for d in batch:
        c = max(1, min(sizes[d], cfg.cores // used))
        while (cfg.cores // used) % c:
            c -= 1
        used *= c
    rest = cfg.cores // used
    if naive:
        # a core's 256 MiB address span may not cover a whole weight (a
        # vocabulary projection's [N, K], K the stick dim): then k over the
        # fewest cores whose share fits
        pm = min(rest, m)
        return [((pm, 1, 1 << i), False) for i in range(max(1, rest // pm).bit_length())]
    if len(cols) != 1:
        return [(None, True)]
    held = cols[0] in {s.dim for s in steps if isinstance(s, Reduce)}
    se = stick_elems(buffers[mm.a].dtype)
    n_sticks = ceil_div(sizes[cols[0]], se)
    kd = sorted((a & b) - o, key=_dkey)
    k_sticks = ceil_div(sizes[kd[0]], se) if len(kd) == 1 else 1
    pows = [1 << i for i in range(rest.bit_length()) if 1 << i <= rest]
    out = []
    for pm in pows:
        for pn in stick_splits(n_sticks, rest):
            for pk in stick_splits(k_sticks, rest):
                if pm * pn * pk > rest or pm > m or (held and pn > 1):
                    continue
                out += [((pm, pn, pk), True), ((pm, pn, pk), False)]
                # rows in several dims (a [B, S, K] activation): the outer one
                # is split when it can take the cores; the inner one is
                # outermost in device memory ([S, K/64, B, 64]), so splitting
                # it is what keeps a large activation and output inside a
                # core's span: a candidate too
                for i, d in enumerate(rows[1:], 1):
                    if pm > 1 and sizes[d] >= pm:
                        out += [((pm, pn, pk, i), True), ((pm, pn, pk, i), False)]
    return out or [(None, True)]


def _pipelined_tiles(split, tiles, loops, steps, reduced, stick_of):
    """Smaller tiles of the outermost loop dim, so each core walks several
    tiles and its loads, compute and stores overlap (a single tile per core
    runs them one after another); the cost model picks (``_plan_dims``)."""
    outer = [d for d in loops if d not in reduced]
    if not outer:
        return []
    d = outer[0]
    if stick_of.get(d):
        return []
    out = []
    t = tiles[d]
    while t > 1 and len(out) < 5:
        t = ceil_div(t, 2)
        out.append((split, {**tiles, d: t}, loops, set(), steps, False))
    return out


def _lx_total(prog: Program, cfg: HardwareConfig) -> int:
    """The LX bytes ``prog`` uses on one core (the tile search asks it for
    every shrink of every candidate)."""
    return sum(prog.lx_usage(cfg).values())


def _fit(
    name, steps, buffers, ops, sizes, reduced, cfg, names, stick_of,
    split, tiles, loops, mm_steps, multicast: bool, has_mm: bool, streamed=None,
) -> Program:  # fmt: skip
    """The program of one split: tiles shrunk until the working set fits half
    the LX (rows streamed when they cannot: in one pass when no row step uses
    a reduction's result, else in several passes over the row, ``_multipass``),
    validated."""

    def ext_of(d: str) -> int:
        n, chunk = split.get(d, (1, None))
        return chunk or -(-sizes[d] // n)

    def build() -> Program:
        dims = tuple(
            Dim(
                d,
                sizes[d],
                *(split.get(d, (1, None))[:1]),
                tile=tiles[d] if d in loops else None,
                chunk=split.get(d, (1, None))[1],
            )
            for d in names
        )
        st = []
        # the k loop of a matmul is innermost: only its loads and the PE-array
        # step are inside it, the epilogue runs once per output tile
        outer = tuple(d for d in loops if d not in reduced)
        for i, s in enumerate(steps):
            lp = loops if i in mm_steps else outer
            if isinstance(s, Load):
                used = [d for d in s.index if d is not None]
                last = max((lp.index(d) for d in used if d in lp), default=-1)
                # a dim the core walks in one tile is no loop for the load:
                # when a loop between it and the load's last walked dim
                # turns more than once, the tile stays in the LX across it
                # instead of being loaded again each time
                walked = [d for d in used if d in lp and tiles[d] < ext_of(d)]
                inner = max((lp.index(d) for d in walked), default=-1)
                if any(tiles[d] < ext_of(d) for d in lp[inner + 1 : last + 1]):
                    last = inner
                # a tile shared by a group of cores: read once, all-gathered
                shared = math.prod(split[d][0] for d in split if d not in used)
                st.append(replace(s, loops=lp[: last + 1], multicast=multicast and shared > 1))
            else:
                st.append(replace(s, loops=lp))
        st = _reuse_operand_tiles(st, mm_steps, buffers, split, tiles, sizes, reduced)
        st = _hoist_short_loads(st)
        return Program(
            name=name,
            dims=dims,
            operands=tuple(
                Operand(u.name, u.layout, "input" if u.role in constants.CONST_ROLES else u.role)
                for u in ops
            ),
            buffers=tuple(buffers.values()),
            steps=tuple(st),
            loop_order=loops,
        )

    # a matmul kernel is the whole program on its cores: it may use all of
    # the LX; other kernels leave half as headroom
    budget = cfg.lx_bytes if has_mm else cfg.lx_bytes // 2
    prog = build()
    while _lx_total(prog, cfg) > budget:
        shrunk = False
        for d in loops:  # outermost first: rows before sticks
            if d in reduced:
                continue
            se = stick_of.get(d)
            if se and d == loops[-1]:
                if tiles[d] > se:
                    tiles[d] = max(se, (tiles[d] // 2) // se * se)
                    shrunk = True
                    break
            elif tiles[d] > 1:
                tiles[d] = max(1, tiles[d] // 2)
                shrunk = True
                break
        if not shrunk:
            break
        prog = build()
    if _lx_total(prog, cfg) > budget and not has_mm and reduced:
        row_steps = _stream_rows(steps, buffers, reduced)
        multi = None
        # several passes only when the rows do not fit the LX at all (a plan
        # over the half-LX budget that fits is kept, as before)
        if row_steps is None and streamed is not None and _lx_total(prog, cfg) > cfg.lx_bytes:
            # a row used after its reduction (softmax, norms): several passes
            multi = _multipass(*streamed, frozenset(reduced))
            if multi is not None:
                steps, buffers, row_steps = multi
        if row_steps is not None:
            # rows longer than the LX: walk the reduced dims in tiles too; a
            # Reduce over a looped dim accumulates over the tiles
            mm_steps = row_steps
            loops = (
                tuple(d for d in loops if d not in reduced)
                + tuple(d for d in names if d in reduced)[:1]
            )
            for d in reversed(loops):
                if d not in reduced:
                    break
                se = stick_of.get(d, 1)
                while _lx_total(build(), cfg) > budget and tiles[d] > se:
                    tiles[d] = max(se, (tiles[d] // 2) // se * se)
            prog = build()
            if multi is not None:
                prog = _balance_row_tiles(prog, build, tiles, loops, reduced, stick_of, cfg, budget)
    prog.validate(cfg)
    return prog


def _reuse_operand_tiles(steps, mm_steps, buffers, split, tiles, sizes, reduced) -> list:
    """An epilogue's load of the tile the matmul read as its operand, along an
    output dim where the matmul read the k dim (RoPE: ``t0 <- q[.., d2]`` for
    ``q @ rotation``, then ``t3 <- q[.., d3]`` for ``q * cos``), reads the
    operand's tile already in LX instead (a ``rename`` of that dim): when
    both dims are the same size, each walked in one tile by every core
    (the k loop then turns once per output tile, so the tile in LX is the
    whole row the epilogue needs) and nothing writes the tile in between."""
    out = list(steps)
    whole = {d for d in sizes if d not in split and tiles.get(d, sizes[d]) >= sizes[d]}
    for j, s in enumerate(out):
        if not isinstance(s, Load) or j in mm_steps or s.rows is not None:
            continue
        for i in sorted(mm_steps):
            t = out[i]
            if not (
                i < j
                and isinstance(t, Load)
                and t.operand == s.operand
                and t.offsets == s.offsets
                and t.rows is None
                and len(t.index) == len(s.index)
                and buffers[t.buffer].dtype == buffers[s.buffer].dtype
            ):
                continue
            differ = [(a, b) for a, b in zip(t.index, s.index) if a != b]
            if len(differ) != 1 or None in differ[0]:
                continue
            a, b = differ[0]
            if not (a in reduced and b not in reduced and sizes[a] == sizes[b] and {a, b} <= whole):
                continue
            if set(buffers[t.buffer].dims) - {a} != set(buffers[s.buffer].dims) - {b}:
                continue
            if any(step_writes(x) == t.buffer for x in out[i + 1 : j]):
                continue  # its LX was handed to another value in between
            out[j] = Vector("rename", s.buffer, (t.buffer,), (), s.loops)
            break
    return out


def _hoist_short_loads(steps: list) -> list:
    """An input loaded in fewer loops than the steps after it (an epilogue's
    per-row scale, [M, 1], read outside the column loop) is loaded before the
    first step that opens those loops, so the loop nest stays one nest (a
    load between two steps of a loop would close it and open a second one)."""
    out = list(steps)
    i = 0
    while i < len(out):
        s = out[i]
        if isinstance(s, Load) and i > 0:
            n = len(s.loops)
            prev = out[i - 1].loops
            later = any(len(t.loops) > n and t.loops[:n] == s.loops for t in out[i + 1 :])
            if len(prev) > n and prev[:n] == s.loops and later:
                # the first step of the run of deeper steps just before it
                j = i - 1
                while j > 0 and len(out[j - 1].loops) > n and out[j - 1].loops[:n] == s.loops:
                    j -= 1
                out.insert(j, out.pop(i))
        i += 1
    return out


def _balance_row_tiles(prog, build, tiles, loops, reduced, stick_of, cfg, budget) -> Program:
    """Rows streamed in several passes: more rows per tile and shorter row
    tiles move the same row bytes but re-read operands as long as a row (a
    norm's weight) fewer times; the cost model picks among the splits of the
    same LX budget that fit."""
    rows = [d for d in loops if d not in reduced]
    red = [d for d in loops if d in reduced]
    if not rows or not red:
        return prog
    ro, rd = rows[-1], red[0]
    se = stick_of.get(rd, 1)
    base = dict(tiles)

    def with_factor(f: int) -> tuple[Program, dict]:
        tiles.update(base)
        tiles[ro] = base[ro] * f
        tiles[rd] = max(se, base[rd] // f // se * se)
        return build(), dict(tiles)

    def fits(built: tuple[Program, dict]) -> bool:
        cand, t = built
        return t[ro] <= cand.dim(ro).core_extent and _lx_total(cand, cfg) <= budget

    found = Search(
        with_factor, cfg, validate=False, fits=fits, cost=lambda b: estimate(b[0], cfg).time_s,
        baseline=Found(1, (prog, dict(base)), estimate(prog, cfg).time_s),
    )  # fmt: skip
    f = 2
    while base[rd] // f >= se:
        found.consider(f)
        f *= 2
    best_prog, best_tiles = found.best.result
    tiles.update(best_tiles)
    return best_prog


# ------------------------------------------------- eager programs, replanned
# The compiler's plan search for eager kernels (issue 18).
#
# An eager op builds its program with a fixed recipe (``kernels/eager.py``: the
# default core split, no operand multicast); the compiler chooses among
# candidate splits, tiles and multicast with the cost model
# (``_plan_dims``).  ``replan`` runs that same search on an eager
# program, so an eager ``a @ b`` is modelled as the compiler would run it
# alone, not up to 7x slower.  Row kernels (layer / RMS norm) take the same
# search: their rows spread over all cores (the recipe puts whole stat
# sticks, 32 rows, on a core) and tiled so the row loop is a pipeline.  The
# result is cached per program (the eager layer also caches the kernel per
# shape), so the hot path plans once.
#
# Only the dims' split, tiles and loops and the loads' multicast change: the
# steps, buffers and operands are the eager program's, so the numbers it
# computes are the same.

_REPLANNED = Memo(persist="replan")


def _renamed(s, ren: dict[str, str]):
    def names(xs):
        return tuple(ren.get(x, x) if x is not None else None for x in xs)

    kw: dict = {"loops": names(s.loops)}
    if isinstance(s, Load | Store):
        kw["index"] = names(s.index)
    if isinstance(s, Reduce | Scan):
        kw["dim"] = ren[s.dim]
    return replace(s, **kw)


def replan(program: Program, cfg: HardwareConfig) -> Program:
    """``program`` with the compiler's choice of split, tiles and multicast;
    ``program`` itself when the search does not serve it (e.g. no plan fits)."""
    return _REPLANNED.get((program, cfg), lambda: _replan(program, cfg))


def _replan(program: Program, cfg: HardwareConfig) -> Program:
    # the compiler names dims x0, x1, ... (outer to inner); the reduced ones
    # are those no store writes (a matmul's k) and those a row step walks
    # whole (a norm's or softmax's row: never split over cores)
    ren = {d.name: f"x{i}" for i, d in enumerate(program.dims)}
    stored = {d for s in program.steps if isinstance(s, Store) for d in s.index if d}
    rows = {s.dim for s in program.steps if isinstance(s, Reduce | Scan)}
    reduced = frozenset(ren[d.name] for d in program.dims if d.name not in stored or d.name in rows)
    steps = [_renamed(s, ren) for s in program.steps]
    buffers = {b.name: replace(b, dims=tuple(ren[d] for d in b.dims)) for b in program.buffers}
    sizes = {ren[d.name]: d.size for d in program.dims}
    try:
        planned = _plan_dims(
            program.name, steps, buffers, list(program.operands), sizes, reduced, cfg
        )
    except (Unsupported, ValueError):
        planned = program
    return planned
