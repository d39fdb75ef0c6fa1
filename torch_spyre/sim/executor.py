"""The functional executor: runs a kernel program on device memory, for real.

Tiles and the core split change *when* work happens, not *what* is computed,
so each step runs once over the whole iteration space as one torch op
(vectorised; no Python loop over tiles or cores).  The one place the split
shows in the numbers is a contraction over a dim split across cores: each
core's partial result is kept (an extra leading axis, one entry per core)
until a ``RingAllReduce`` combines them, as the card does.

Numerics follow the card: matmuls and reductions accumulate in fp32 (PE array
and SFU accumulators); 16-bit elementwise ops compute in fp32 and round once
to the output buffer's dtype; loads/stores convert between the operand's and
the buffer's dtype.

A program is compiled once into straight-line step closures (``runner``):
every name lookup, axis permutation and einsum equation is worked out at
build time, so a warm launch runs only the torch ops.  Operands are read
through ``hostviews`` (host-layout views kept across launches).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from torch_spyre import dl16
from torch_spyre import layout as layout_mod
from torch_spyre.ir import (
    Load,
    Matmul,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    Scan,
    Store,
    Vector,
    sole_load,
    transfer_dims,
)
from torch_spyre.ir import vector_ops as ops_mod
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import direct
from torch_spyre.sim.hostviews import VIEWS

_P = "@"  # prefix of a per-core partial axis name
_HALF = (torch.float16, torch.bfloat16)

Buffers = dict[str, torch.Tensor]
Runner = Callable[[Buffers], None]


#: integers the vector unit holds exactly: it computes in fp32 (a 24-bit
#: significand; docs/hardware.md, "dtypes": no integer ALU beyond 8-bit PE data)
EXACT_INT = 2**24


class IntegerRangeError(RuntimeError):
    """An integer operand of a vector op is beyond what the card computes exactly."""


def check_ints(op: str, tensors) -> None:
    """Raise ``IntegerRangeError`` when an integer (not bool) input of vector op
    ``op`` holds a value of magnitude 2**24 or more: the card would compute it
    in fp32 and round it (a silent wrong answer); the error says so instead."""
    for t in tensors:
        if (
            isinstance(t, torch.Tensor)
            and not t.is_floating_point()
            and t.dtype != torch.bool
            and t.numel()
            and int(t.abs().max()) >= EXACT_INT
        ):
            raise IntegerRangeError(
                f"spyre: {op!r} of {t.dtype} values up to {int(t.abs().max())}: "
                f"the card computes integers in fp32, exact only below 2**24 "
                f"({EXACT_INT:,}). Compute this on the CPU (tensor.cpu()) or keep the "
                "integers smaller."
            )


def _rounder(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a value is rounded into an LX buffer of ``dtype``: to ``dtype``, or
    for 16-bit floats on a DL16 card to DL16 (held in fp32: torch has no DL16)."""
    if dtype in _HALF and layout_mod.FP16_FORMAT == "dl16":
        return dl16.round_trip
    return lambda t: t.to(dtype)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    # 16-bit and 8-bit floats are computed in fp32 and rounded once
    return torch.float32 if dt in _HALF or dt in layout_mod.FP8_DTYPES else dt


def _held_dtype(operand: torch.dtype, buffer: torch.dtype) -> torch.dtype:
    """The dtype a loaded buffer is held in.

    Every consumer of a 16-bit float buffer computes in fp32 (the PE array
    and the vector unit accumulate in fp32), so a buffer loaded from an
    operand of its own dtype is held in fp32: the same values, converted once
    (and kept across launches by ``hostviews``) instead of at every use.
    """
    if buffer in _HALF and operand == buffer:
        return torch.float32
    if buffer == torch.float32 and (operand in _HALF or operand == torch.float32):
        return torch.float32
    return buffer


def execute(program: Program, buffers: Buffers, validate: bool = True) -> None:
    """Run ``program``; ``buffers`` maps operand names to device-memory tensors.

    Each tensor holds the operand in its device layout (``layout.dtype``,
    ``layout.device_size`` elements, row-major); outputs are written in place.
    """
    if validate:
        program.validate()
    runner(program)(buffers)


# program id -> (program, its runner, built with in-place weight reads?): built
# once per program object, again when ``direct.set_enabled`` changed the path
_runners: dict[int, tuple[Program, Runner, bool]] = {}


def runner(program: Program) -> Runner:
    """The compiled runner of ``program`` (built on first use)."""
    hit = _runners.get(id(program))
    on = direct.enabled()
    if hit is not None and hit[0] is program and hit[2] == on:
        return hit[1]
    r = _compile(program)
    if len(_runners) > 8192:
        _runners.clear()
    _runners[id(program)] = (program, r, on)
    return r


def build_step(program: Program, step, dims: dict[str, tuple[str, ...]]) -> Callable:
    """One step's closure ``(buffers, env) -> None``; ``dims`` maps each env
    buffer to its axes and is updated with the step's output."""
    return _STEP_BUILDERS[type(step)](program, step, dims)


def _compile(program: Program) -> Runner:
    checks = tuple(
        (o.name, o.layout.dtype, o.layout.device_numel, o.layout.device_size)
        for o in program.operands
    )
    name = program.name

    def check(buffers: Buffers) -> None:
        for op, dtype, numel, size in checks:
            t = buffers.get(op)
            if t is None:
                raise ProgramError(f"kernel {name!r}: no device buffer for operand {op!r}")
            if t.dtype != dtype or t.numel() != numel:
                raise ProgramError(
                    f"kernel {name!r}: operand {op!r} needs {numel} elements of {dtype} "
                    f"(device size {list(size)}), got {t.numel()} of {t.dtype}"
                )

    fast = _same_layout_elementwise(program)
    if fast is not None:

        def run_fast(buffers: Buffers) -> None:
            check(buffers)
            fast(buffers)

        # for callers whose operands are known to fit (a warm eager call whose
        # signature fixed every operand's shape, dtype and whole default layout)
        run_fast.unchecked = fast  # type: ignore[attr-defined]
        return run_fast

    steps: list[Callable[[Buffers, dict], None]] = []
    dims: dict[str, tuple[str, ...]] = {}  # env buffer -> its axes, as the steps leave it
    presplit = _presplit(program)
    # matmuls that read their weight in place (sim/direct.py): their loads are
    # views, and their other operand is not presplit (the kernel splits k)
    direct_mm = direct.plan(program)
    direct_load = {p.load: p for p in direct_mm.values()}
    direct_bufs = {b for p in direct_mm.values() for b in (p.weight, p.act)}
    presplit = {i: v for i, v in presplit.items() if program.steps[i].buffer not in direct_bufs}
    for i, s in enumerate(program.steps):
        if i in direct_load:
            steps.append(direct.build_load(program, s, dims, direct_load[i]))
        elif i in direct_mm:
            steps.append(
                direct.build_matmul(program, s, dims, direct_mm[i], _matmul_rounder(program, s))
            )
        elif i in presplit:
            steps.append(_build_load(program, s, dims, presplit[i]))
        else:
            steps.append(build_step(program, s, dims))
    steps_t = tuple(steps)

    def run(buffers: Buffers) -> None:
        check(buffers)
        env: dict[str, torch.Tensor] = {}
        for step in steps_t:
            step(buffers, env)

    return run


# ------------------------------------------------------------ alignment
class _Align:
    """A tensor with axes ``src`` viewed with axes ``dst`` (missing ones size 1).

    The same permute-then-reshape as a by-name alignment, worked out once.
    """

    __slots__ = ("perm", "where", "identity")

    def __init__(self, src: tuple[str, ...], dst: tuple[str, ...]) -> None:
        perm = [src.index(d) for d in dst if d in src]
        self.perm = None if perm == list(range(len(perm))) else tuple(perm)
        present = [d for d in dst if d in src]
        pos = {d: i for i, d in enumerate(present)}
        self.where = tuple(pos.get(d, -1) for d in dst)
        self.identity = self.perm is None and len(present) == len(dst) == len(src)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return t
        if self.perm is not None:
            t = t.permute(self.perm)
        shape = t.shape
        return t.reshape([shape[w] if w >= 0 else 1 for w in self.where])


# ---------------------------------------------------------------- steps
def _presplit(program: Program) -> dict[int, tuple[str, int, int, int]]:
    """Loads whose buffer feeds only a matmul that splits it unevenly over cores.

    Such a split pads the operand with zeros (a copy of a whole weight on
    every launch); done by the load instead, the padded split is what
    ``hostviews`` keeps for the operand, so a warm launch copies nothing.
    Returns {load step index: (dim, cores, size, chunk)}.
    """
    steps = program.steps
    out: dict[int, tuple[str, int, int, int]] = {}
    for m, st in enumerate(steps):
        if not isinstance(st, Matmul):
            continue
        mm_out = program.buffer(st.out).dims
        for name in (st.a, st.b):
            w = None if st.a == st.b else sole_load(steps, m, name)
            if w is None:
                continue
            other = program.buffer(st.b if name == st.a else st.a).dims
            split = [
                d
                for d in program.buffer(name).dims
                if d in other and d not in mm_out and program.dim(d).cores > 1
            ]
            if len(split) != 1:
                continue
            dd = program.dim(split[0])
            if dd.core_extent * dd.cores != dd.size:
                out[w] = (split[0], dd.cores, dd.size, dd.core_extent)
    return out


def _load_dtype(layout: SpyreTensorLayout, buf) -> tuple[torch.dtype, Callable | None]:
    """The dtype a loaded buffer is held in, and the rounding on the way in:
    a DL16 card rounds a wider float into a 16-bit buffer as DL16, held in fp32."""
    held = _held_dtype(layout.dtype, buf.dtype)
    if buf.dtype in _HALF and layout_mod.FP16_FORMAT == "dl16" and layout.dtype.is_floating_point:
        return torch.float32, (None if layout.dl16 else dl16.round_trip)
    return held, None


def _paged_offsets(program: Program, s: Load | Store) -> tuple[torch.Tensor, tuple[str, ...]]:
    """For a paged transfer: the device element offsets (flat, host order)
    of one row's elements along the operand's other host dims, and their
    iteration dims."""
    lay = program.operand(s.operand).layout
    offs = s.offsets or (0,) * len(s.index)
    inner = torch.zeros((), dtype=torch.int64)
    axes: list[str] = []
    for k, d in enumerate(s.index):
        if k == s.rows_dim:
            continue
        tab = lay.dim_offsets[k]
        if d is None:
            inner = inner + tab[offs[k]]
        else:
            inner = inner[..., None] + tab[offs[k] : offs[k] + program.dim(d).size]
            axes.append(d)
    return inner.reshape(-1), tuple(axes)


def _build_paged_load(program: Program, s: Load, dims: dict) -> Callable:
    """Rows gathered from device memory through a row table (a KV cache's
    pages): only the rows a launch reads are converted, never the whole
    operand (which other kernels keep writing)."""
    op = program.operand(s.operand)
    buf = program.buffer(s.buffer)
    lay = op.layout
    held, to_buf = _load_dtype(lay, buf)
    inner, axes = _paged_offsets(program, s)
    table = s.rows
    align = _Align(transfer_dims(program, s), buf.dims)
    tail = [program.dim(a).size for a in axes]
    row_tab = lay.dim_offsets[s.rows_dim]
    # Each row's elements lie in one window of device memory (a stick row,
    # with V's sticks between K's in a KV cache): gather whole windows, then
    # pick the row's elements from them -- two torch ops, no per-element
    # offsets -- unless the window is mostly other data.
    lo = int(inner.min()) if inner.numel() else 0
    width = int(inner.max()) - lo + 1 if inner.numel() else 0
    windowed = 0 < width <= 4 * inner.numel()
    cols = inner - lo
    whole_window = windowed and torch.equal(cols, torch.arange(width))
    operand, out = s.operand, s.buffer
    dims[out] = buf.dims

    def load(buffers: Buffers, env: dict) -> None:
        mem = buffers[operand].reshape(-1)
        rows = env[table].to(torch.int64).clamp(min=0)
        base = row_tab[rows.reshape(-1)]
        if windowed:
            win = mem.as_strided((mem.numel() - width + 1, width), (1, 1), mem.storage_offset())
            vals = win.index_select(0, base + lo)
            if not whole_window:
                vals = vals[:, cols]
        else:
            vals = mem[base[:, None] + inner[None, :]]
        if to_buf is not None:
            vals = to_buf(vals)
        env[out] = align(vals.to(held).reshape(*rows.shape, *tail))

    return load


def _build_load(
    program: Program, s: Load, dims: dict, split: tuple[str, int, int, int] | None = None
) -> Callable:
    if s.rows:
        return _build_paged_load(program, s, dims)
    op = program.operand(s.operand)
    buf = program.buffer(s.buffer)
    layout = op.layout
    held, to_buf = _load_dtype(layout, buf)
    keep_view = op.role == "input"
    narrows = tuple(
        (k, off, 1 if d is None else program.dim(d).size)
        for k, (d, off) in enumerate(zip(s.index, s.offsets))
    )
    kept = [k for k, d in enumerate(s.index) if d is not None]
    src = tuple(s.index[k] for k in kept)
    align = _Align(src, buf.dims)
    operand, out = s.operand, s.buffer
    dims[out] = buf.dims
    read = VIEWS.read

    def value(host: torch.Tensor) -> torch.Tensor:
        if to_buf is not None:
            host = to_buf(host)
        for k, off, size in narrows:  # a sub-block of the operand
            host = host.narrow(k, off, size)
        shape = host.shape
        return align(host.reshape([shape[k] for k in kept]))

    if split is None:

        def load(buffers: Buffers, env: dict) -> None:
            env[out] = value(read(buffers[operand], layout, held, keep_view))

        return load

    d, cores, size, chunk = split
    ax = buf.dims.index(d)
    dims[out] = (_P + d,) + buf.dims

    def padded_split(host: torch.Tensor) -> torch.Tensor:
        return _split_axis(value(host), ax, cores, size, chunk, 0.0)

    # what hostviews keeps for this operand: the padded split, named by its recipe
    recipe = ("split", narrows, tuple(kept), align.perm, align.where, ax, cores, chunk)
    derive = (recipe, padded_split)

    def load_split(buffers: Buffers, env: dict) -> None:
        env[out] = read(buffers[operand], layout, held, keep_view, derive)

    return load_split


def _build_paged_store(program: Program, s: Store, dims: dict) -> Callable:
    """Rows scattered into device memory through a row table; a negative row
    number (a padded query) is not written."""
    lay = program.operand(s.operand).layout
    inner, _ = _paged_offsets(program, s)
    table = s.rows
    align = _Align(dims[s.buffer], transfer_dims(program, s))
    row_tab = lay.dim_offsets[s.rows_dim]
    operand, buffer, dtype = s.operand, s.buffer, lay.dtype
    written = VIEWS.written

    def store(buffers: Buffers, env: dict) -> None:
        mem = buffers[operand]
        try:
            rows = env[table].to(torch.int64).reshape(-1)
            keep = rows >= 0
            vals = align(env[buffer]).reshape(rows.numel(), -1)[keep]
            offs = row_tab[rows[keep]][:, None] + inner[None, :]
            mem.reshape(-1)[offs.reshape(-1)] = vals.reshape(-1).to(dtype)
        finally:
            written(mem)

    return store


def _build_store(program: Program, s: Store, dims: dict) -> Callable:
    if s.rows:
        return _build_paged_store(program, s, dims)
    op = program.operand(s.operand)
    layout = op.layout
    src = dims[s.buffer]
    align = _Align(src, tuple(d for d in s.index if d is not None))
    operand, buffer, host_size = s.operand, s.buffer, layout.host_size
    written = VIEWS.written
    if s.offsets:
        # a sub-block: the device offsets of its elements, from the layout's
        # per-dim offset tables (only those elements are written)
        block = [1 if d is None else program.dim(d).size for d in s.index]
        offs = torch.zeros((), dtype=torch.int64)
        for k, (off, n) in enumerate(zip(s.offsets, block)):
            tab = layout.dim_offsets[k][off : off + n]
            offs = offs + tab.reshape([1] * k + [n] + [1] * (len(block) - k - 1))
        flat_offs = offs.reshape(-1)
        dtype = layout.dtype

        def store_block(buffers: Buffers, env: dict) -> None:
            mem = buffers[operand]
            try:
                vals = align(env[buffer]).reshape(-1).to(dtype)
                mem.reshape(-1)[flat_offs] = vals
            finally:
                written(mem)

        return store_block

    # a value computed in fp32 stored into an integer operand: exact only in range
    to_int = program.buffer(s.buffer).dtype.is_floating_point and not (
        layout.dtype.is_floating_point or layout.dtype == torch.bool
    )

    def store(buffers: Buffers, env: dict) -> None:
        mem = buffers[operand]
        if to_int:
            check_ints(f"store of {operand}", [env[buffer].to(torch.int64)])
        try:
            layout.store(mem, align(env[buffer]).reshape(host_size))
        finally:
            written(mem)

    return store


def _build_vector(program: Program, s: Vector, dims: dict) -> Callable:
    od = ops_mod.vector_op(s.op)
    out_buf = program.buffer(s.out)
    if s.op == "rename":
        return _build_rename(s, dims, out_buf)
    if s.op == "rotate_half":
        return _build_rotate_half(s, dims, out_buf)
    aligns = tuple(_Align(dims[x], out_buf.dims) for x in s.inputs)
    inputs, scalars, out, fn = s.inputs, s.scalars, s.out, od.fn
    out_dtype = out_buf.dtype
    to_out = _rounder(out_dtype)
    acc = _acc_dtype(out_dtype)
    cast = acc.is_floating_point  # comparisons etc. (bool/int out) keep their input types
    #: an integer input computed into an fp32 result: checked against the
    #: exact range (integer results of integer inputs are exact: min, bit ops)
    ints = out_dtype.is_floating_point and any(
        not program.buffer(x).dtype.is_floating_point and program.buffer(x).dtype != torch.bool
        for x in s.inputs
    )
    fill = None
    if not s.inputs and out_buf.dims:  # a fill: the whole output buffer
        fill = [program.dim(d).size for d in out_buf.dims]
    dims[out] = out_buf.dims

    op_name = s.op

    def vector(buffers: Buffers, env: dict) -> None:
        args = [a(env[x]) for a, x in zip(aligns, inputs)]
        if ints:
            check_ints(op_name, args)
        if cast:
            args = [a.to(acc) if a.dtype != acc and a.is_floating_point() else a for a in args]
        res = fn(*args, *scalars)
        if fill is not None:
            res = res.expand(fill)
        env[out] = to_out(res)

    return vector


def _build_rename(s: Vector, dims: dict, out_buf) -> Callable:
    """The input under its one dim the output names otherwise (validated:
    same size, not split over cores), aligned to the output's dims."""
    src = dims[s.inputs[0]]
    (old,) = set(src) - set(out_buf.dims)
    (new,) = set(out_buf.dims) - set(src)
    align = _Align(tuple(new if d == old else d for d in src), out_buf.dims)
    inp, out = s.inputs[0], s.out
    dims[out] = out_buf.dims

    def rename(buffers: Buffers, env: dict) -> None:
        env[out] = align(env[inp])

    return rename


def _build_rotate_half(s: Vector, dims: dict, out_buf) -> Callable:
    """``cat(-x[1], x[0])`` along ``s.dim`` (validated: size 2, the same dims)."""
    align = _Align(dims[s.inputs[0]], out_buf.dims)
    ax = out_buf.dims.index(s.dim)
    inp, out = s.inputs[0], s.out
    dims[out] = out_buf.dims

    def rotate_half(buffers: Buffers, env: dict) -> None:
        x = align(env[inp])
        lo, hi = x.narrow(ax, 0, 1), x.narrow(ax, 1, 1)
        env[out] = torch.cat((-hi, lo), ax)

    return rotate_half


def _split_axis(
    t: torch.Tensor, ax: int, cores: int, size: int, chunk: int, pad: float
) -> torch.Tensor:
    """Split axis ``ax`` into (cores, per-core chunk); the core axis goes first."""
    if chunk * cores != size:
        padding = [0, 0] * (t.dim() - ax - 1) + [0, chunk * cores - size]
        if not t.is_floating_point() and t.dtype != torch.bool and math.isinf(pad):
            # an integer max/min pads with its type's extreme, not +-inf (F.pad
            # takes its value through a double: int64's extremes do not survive)
            info = torch.iinfo(t.dtype)
            fill = torch.full(
                (*t.shape[:ax], chunk * cores - size, *t.shape[ax + 1 :]),
                info.max if pad > 0 else info.min,
                dtype=t.dtype,
            )
            t = torch.cat([t, fill], dim=ax)
        else:
            t = torch.nn.functional.pad(t, padding, value=pad)
    return t.unflatten(ax, (cores, chunk)).movedim(ax, 0)


def _matmul_rounder(program: Program, s: Matmul) -> Callable:
    """The rounding of a matmul's fp32 sums into its env buffer: none for
    per-core partial sums (a k split over cores), else the buffer's dtype."""
    out_buf = program.buffer(s.out)
    acc = _acc_dtype(out_buf.dtype) if out_buf.dtype.is_floating_point else torch.float32
    split = any(
        program.dim(d).cores > 1
        for d in program.buffer(s.a).dims
        if d in program.buffer(s.b).dims and d not in out_buf.dims
    )
    return _rounder(acc if split else out_buf.dtype)


def _build_matmul(program: Program, s: Matmul, dims: dict) -> Callable:
    out_buf = program.buffer(s.out)
    a_dims, b_dims = dims[s.a], dims[s.b]
    k = [d for d in a_dims if d in b_dims and d not in out_buf.dims and not d.startswith(_P)]
    split_a, split_b = [], []  # (axis at the time of its split, cores, size, chunk)
    for d in k:
        dd = program.dim(d)
        if dd.cores > 1:
            # an operand its load already split (see _presplit) has the partial axis
            if _P + d not in a_dims:
                split_a.append((a_dims.index(d), dd.cores, dd.size, dd.core_extent))
                a_dims = (_P + d,) + a_dims
            if _P + d not in b_dims:
                split_b.append((b_dims.index(d), dd.cores, dd.size, dd.core_extent))
                b_dims = (_P + d,) + b_dims
    letters = {d: chr(ord("a") + i) for i, d in enumerate(dict.fromkeys(a_dims + b_dims))}
    partial = tuple(_P + d for d in k if program.dim(d).cores > 1)
    out_dims = partial + out_buf.dims
    eq = (
        "".join(letters[d] for d in a_dims)
        + ","
        + "".join(letters[d] for d in b_dims)
        + "->"
        + "".join(letters[d] for d in out_dims)
    )
    to_res = _matmul_rounder(program, s)
    a, b, out = s.a, s.b, s.out
    dims[out] = out_dims
    f32 = torch.float32

    def matmul(buffers: Buffers, env: dict) -> None:
        ta, tb = env[a], env[b]
        for ax, cores, size, chunk in split_a:
            ta = _split_axis(ta, ax, cores, size, chunk, 0.0)
        for ax, cores, size, chunk in split_b:
            tb = _split_axis(tb, ax, cores, size, chunk, 0.0)
        # fp32 accumulation like the PE array; einsum lowers to one (batched) GEMM
        r = torch.einsum(eq, ta.to(f32), tb.to(f32))
        env[out] = to_res(r)

    return matmul


def _build_reduce(program: Program, s: Reduce, dims: dict) -> Callable:
    rd = ops_mod.reduction(s.op)
    out_buf = program.buffer(s.out)
    src = dims[s.input]
    dd = program.dim(s.dim)
    split = None
    if dd.cores > 1:
        split = (src.index(s.dim), dd.cores, dd.size, dd.core_extent, rd.identity)
        src = (_P + s.dim,) + src
    ax = src.index(s.dim)
    rest = tuple(d for d in src if d != s.dim)
    partial = tuple(d for d in rest if d.startswith(_P))
    out_dims = partial + out_buf.dims
    align = _Align(rest, out_dims)
    inp, out, fn, to_out = s.input, s.out, rd.fn, _rounder(out_buf.dtype)
    dims[out] = out_dims
    f32 = torch.float32
    int_out = not (out_buf.dtype.is_floating_point or out_buf.dtype == torch.bool)
    name = f"{s.op} reduction"

    def reduce(buffers: Buffers, env: dict) -> None:
        t = env[inp]
        held = int_out and t.is_floating_point()  # integers held in fp32
        if held:
            check_ints(name, [t.to(torch.int64)])
        if t.is_floating_point():
            t = t.to(f32)
        if split is not None:
            t = _split_axis(t, *split)
        res = align(fn(t, ax))
        if held:
            check_ints(name, [res.to(torch.int64)])
        env[out] = res if partial else to_out(res)

    return reduce


def _build_scan(program: Program, s: Scan, dims: dict) -> Callable:
    out_buf = program.buffer(s.out)
    out_dims = out_buf.dims
    ax = out_dims.index(s.dim)
    aligns = tuple(_Align(dims[x], out_dims) for x in s.inputs)
    inputs, out, op, out_dtype = s.inputs, s.out, s.op, out_buf.dtype
    shape = tuple(program.dim(d).size for d in out_dims)
    f32 = torch.float32
    dims[out] = out_dims

    int_out = not (out_dtype.is_floating_point or out_dtype == torch.bool)

    def scan(buffers: Buffers, env: dict) -> None:
        args = [a(env[x]).to(f32) for a, x in zip(aligns, inputs)]
        if op == "cumsum":
            res = torch.cumsum(args[0].expand(shape), ax)
            if int_out:
                check_ints("cumsum", [res.to(torch.int64)])
            env[out] = res.to(out_dtype)
            return
        a, u = args[0].expand(shape), args[1].expand(shape)
        prev = args[2].expand(shape).narrow(ax, 0, 1) if len(args) == 3 else None
        res = torch.empty(shape, dtype=f32)
        for i in range(shape[ax]):  # element i needs element i - 1
            cur = u.narrow(ax, i, 1)
            if prev is not None:
                cur = a.narrow(ax, i, 1) * prev + cur
            res.narrow(ax, i, 1).copy_(cur)
            prev = cur
        env[out] = res.to(out_dtype)

    return scan


def _build_allreduce(program: Program, s: RingAllReduce, dims: dict) -> Callable:
    rd = ops_mod.reduction(s.op)
    src = dims[s.buffer]
    ax = src.index(_P + s.dim)
    rest = src[:ax] + src[ax + 1 :]
    final = not any(d.startswith(_P) for d in rest)
    to_buf = _rounder(program.buffer(s.buffer).dtype)
    name, fn = s.buffer, rd.fn
    dims[name] = rest

    def allreduce(buffers: Buffers, env: dict) -> None:
        r = fn(env[name], ax)
        env[name] = to_buf(r) if final else r

    return allreduce


_STEP_BUILDERS: dict[type, Callable] = {
    Load: _build_load,
    Store: _build_store,
    Vector: _build_vector,
    Matmul: _build_matmul,
    Reduce: _build_reduce,
    Scan: _build_scan,
    RingAllReduce: _build_allreduce,
}


# ------------------------------------------- the commonest eager kernel
def _same_layout_elementwise(program: Program) -> Callable[[Buffers], None] | None:
    """A direct runner for the commonest eager kernel: loads of whole operands
    that share one device layout, one vector op, one store.

    Elementwise work does not care where an element sits, so it runs on the
    device tensors as they lie (sticks, padding and all: padding is never
    read back as a value), skipping the layout round trip.  Same numbers as
    the general path.
    """
    steps = program.steps
    names = tuple(d.name for d in program.dims)
    if not (
        len(steps) >= 3
        and all(isinstance(s, Load) for s in steps[:-2])
        and isinstance(steps[-2], Vector)
        and steps[-2].dim is None  # an op along a dim moves elements
        and isinstance(steps[-1], Store)
    ):
        return None
    loads, vec, store = steps[:-2], steps[-2], steps[-1]

    # one element position must mean one host index in every operand:
    # equal device sizes are not enough (another stick dim can have them)
    def where(lay: SpyreTensorLayout) -> tuple:
        return (lay.host_size, lay.device_size, lay.dim_map)

    layouts = {where(program.operand(s.operand).layout) for s in loads}
    layouts.add(where(program.operand(store.operand).layout))
    bufs = {s.buffer: program.buffer(s.buffer) for s in loads}
    if not (
        len(layouts) == 1
        and all(s.index == names and not s.offsets and not s.rows for s in loads)
        and store.index == names
        and not store.offsets
        and not store.rows
        and all(bufs[s.buffer].dtype == program.operand(s.operand).layout.dtype for s in loads)
        and tuple(vec.inputs) == tuple(s.buffer for s in loads)
        and vec.out == store.buffer
        and len({s.buffer for s in loads}) == len(loads)
    ):
        return None
    if any(program.operand(s.operand).layout.dl16 for s in (*loads, store)):
        return None  # DL16 device memory: values through the layouts (general path)
    od = ops_mod.vector_op(vec.op)
    out_dtype = program.buffer(vec.out).dtype
    acc = _acc_dtype(out_dtype)
    operands = [s.operand for s in loads]
    scalars = vec.scalars
    out_name = store.operand
    fn = od.fn
    written = VIEWS.written

    # A simple op (add, mul, compare...) on inputs of the output's dtype
    # is exact in that dtype after one rounding, as torch computes it;
    # anything else computes in fp32 and rounds once, like the vector
    # unit (torch's vectorised 16-bit kernels may round intermediates).
    direct = od.cost_class == "simple" and all(
        program.operand(o).layout.dtype == out_dtype for o in operands
    )
    upcast = not direct and acc.is_floating_point
    out_fn = od.out_fn if direct else None
    ints = out_dtype.is_floating_point and any(
        not (dt := program.operand(o).layout.dtype).is_floating_point and dt != torch.bool
        for o in operands
    )

    if out_fn is not None:
        # computed straight into device memory: the op's own out= form, in the
        # output dtype as above (inputs of the output's dtype), so same numbers

        def run_into(buffers: Buffers) -> None:
            out = buffers[out_name]
            args = [buffers[o] for o in operands]
            if ints:
                check_ints(vec.op, args)
            try:
                out_fn(*args, *scalars, out=out)
            finally:
                written(out)

        # what the runtime's C++ warm path must compute to match (csrc/warm.cpp)
        run_into.form = "out"  # type: ignore[attr-defined]
        return run_into

    def run(buffers: Buffers) -> None:
        args = [buffers[o] for o in operands]
        if ints:
            check_ints(vec.op, args)
        if upcast:
            args = [a.to(acc) if a.is_floating_point() else a for a in args]
        res = fn(*args, *scalars)
        out = buffers[out_name]
        try:
            out.view(res.shape).copy_(res)
        finally:
            written(out)

    run.form = "upcast" if upcast else "plain"  # type: ignore[attr-defined]
    return run
