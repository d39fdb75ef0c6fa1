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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import ops as ops_mod
from torch_spyre.sim.program import (
    Load,
    Matmul,
    Program,
    ProgramError,
    Reduce,
    RingAllReduce,
    Store,
    Vector,
)

_P = "@"  # prefix of a per-core partial axis name


class _Value:
    """A tensor whose axes are named by iteration dims (partial axes first)."""

    __slots__ = ("t", "dims")

    def __init__(self, t: torch.Tensor, dims: tuple[str, ...]) -> None:
        self.t, self.dims = t, dims

    def aligned(self, dims: tuple[str, ...]) -> torch.Tensor:
        """This value viewed with axes ``dims`` (missing ones broadcast, size 1)."""
        perm = [self.dims.index(d) for d in dims if d in self.dims]
        t = self.t.permute(perm) if perm != list(range(len(perm))) else self.t
        shape = [t.shape[perm.index(self.dims.index(d))] if d in self.dims else 1 for d in dims]
        return t.reshape(shape)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def execute(program: Program, buffers: dict[str, torch.Tensor], validate: bool = True) -> None:
    """Run ``program``; ``buffers`` maps operand names to device-memory tensors.

    Each tensor holds the operand in its device layout (``layout.dtype``,
    ``layout.device_size`` elements, row-major); outputs are written in place.
    """
    if validate:
        program.validate()
    fast = _same_layout_elementwise(program)
    for name, dtype, numel, size in _operand_checks(program):
        t = buffers.get(name)
        if t is None:
            raise ProgramError(f"kernel {program.name!r}: no device buffer for operand {name!r}")
        if t.dtype != dtype or t.numel() != numel:
            raise ProgramError(
                f"kernel {program.name!r}: operand {name!r} needs {numel} elements of {dtype} "
                f"(device size {list(size)}), got {t.numel()} of {t.dtype}"
            )
    if fast is not None:
        fast(buffers)
        return
    env: dict[str, _Value] = {}
    for s in program.steps:
        if isinstance(s, Load):
            env[s.buffer] = _load(program, s, buffers)
        elif isinstance(s, Store):
            _store(program, s, env[s.buffer], buffers)
        elif isinstance(s, Vector):
            env[s.out] = _vector(program, s, env)
        elif isinstance(s, Matmul):
            env[s.out] = _matmul(program, s, env)
        elif isinstance(s, Reduce):
            env[s.out] = _reduce(program, s, env)
        elif isinstance(s, RingAllReduce):
            env[s.buffer] = _allreduce(program, s, env[s.buffer])


_checks: dict[int, tuple[Program, tuple]] = {}


def _operand_checks(program: Program) -> tuple:
    """(name, dtype, device numel, device size) of each operand, once per program."""
    hit = _checks.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1]
    checks = tuple(
        (o.name, o.layout.dtype, o.layout.device_numel, o.layout.device_size)
        for o in program.operands
    )
    if len(_checks) > 8192:
        _checks.clear()
    _checks[id(program)] = (program, checks)
    return checks


# program id -> (program, specialised runner or None); see _same_layout_elementwise
_specialised: dict[int, tuple[Program, Callable[[dict[str, torch.Tensor]], None] | None]] = {}


def _same_layout_elementwise(program: Program) -> Callable[[dict[str, torch.Tensor]], None] | None:
    """A direct runner for the commonest eager kernel: loads of whole operands
    that share one device layout, one vector op, one store.

    Elementwise work does not care where an element sits, so it runs on the
    device tensors as they lie (sticks, padding and all: padding is never
    read back as a value), skipping the layout round trip.  Same numbers as
    the general path; built once per program.
    """
    hit = _specialised.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1]
    runner = None
    steps = program.steps
    names = tuple(d.name for d in program.dims)
    if (
        len(steps) >= 3
        and all(isinstance(s, Load) for s in steps[:-2])
        and isinstance(steps[-2], Vector)
        and isinstance(steps[-1], Store)
    ):
        loads, vec, store = steps[:-2], steps[-2], steps[-1]

        # one element position must mean one host index in every operand:
        # equal device sizes are not enough (another stick dim can have them)
        def where(lay: SpyreTensorLayout) -> tuple:
            return (lay.host_size, lay.device_size, lay.dim_map)

        layouts = {where(program.operand(s.operand).layout) for s in loads}
        out_op = program.operand(store.operand)
        layouts.add(where(out_op.layout))
        bufs = {s.buffer: program.buffer(s.buffer) for s in loads}
        if (
            len(layouts) == 1
            and all(s.index == names for s in loads)
            and store.index == names
            and all(bufs[s.buffer].dtype == program.operand(s.operand).layout.dtype for s in loads)
            and tuple(vec.inputs) == tuple(s.buffer for s in loads)
            and vec.out == store.buffer
            and len({s.buffer for s in loads}) == len(loads)
        ):
            od = ops_mod.vector_op(vec.op)
            out_dtype = program.buffer(vec.out).dtype
            acc = _acc_dtype(out_dtype)
            operands = [s.operand for s in loads]
            scalars = vec.scalars

            # A simple op (add, mul, compare...) on inputs of the output's dtype
            # is exact in that dtype after one rounding, as torch computes it;
            # anything else computes in fp32 and rounds once, like the vector
            # unit (torch's vectorised 16-bit kernels may round intermediates).
            direct = od.cost_class == "simple" and all(
                program.operand(o).layout.dtype == out_dtype for o in operands
            )

            def runner(buffers: dict[str, torch.Tensor]) -> None:
                args = [buffers[o] for o in operands]
                if not direct and acc.is_floating_point:
                    args = [a.to(acc) if a.is_floating_point() else a for a in args]
                res = od.fn(*args, *scalars)
                buffers[store.operand].view(res.shape).copy_(res)

    if len(_specialised) > 8192:
        _specialised.clear()
    _specialised[id(program)] = (program, runner)
    return runner


def _load(program: Program, s: Load, buffers: dict[str, torch.Tensor]) -> _Value:
    op = program.operand(s.operand)
    host = op.layout.to_host(buffers[s.operand].view(op.layout.device_size))
    if s.offsets:  # a sub-block of the operand
        for k, (d, off) in enumerate(zip(s.index, s.offsets)):
            host = host.narrow(k, off, 1 if d is None else program.dim(d).size)
    keep = [k for k, d in enumerate(s.index) if d is not None]
    host = host.reshape([host.shape[k] for k in keep])
    buf = program.buffer(s.buffer)
    v = _Value(host, tuple(s.index[k] for k in keep))
    return _Value(v.aligned(buf.dims).to(buf.dtype), buf.dims)


def _store(program: Program, s: Store, v: _Value, buffers: dict[str, torch.Tensor]) -> None:
    op = program.operand(s.operand)
    dims = tuple(d for d in s.index if d is not None)
    host = v.aligned(dims).reshape(op.layout.host_size).to(op.layout.dtype)
    buffers[s.operand].view(op.layout.device_size).copy_(op.layout.to_device(host))


def _vector(program: Program, s: Vector, env: dict[str, _Value]) -> _Value:
    od = ops_mod.vector_op(s.op)
    out = program.buffer(s.out)
    args = [env[x].aligned(out.dims) for x in s.inputs]
    acc = _acc_dtype(out.dtype)
    if acc.is_floating_point:  # comparisons etc. (bool/int out) keep their input types
        args = [a.to(acc) if a.dtype != acc and a.is_floating_point() else a for a in args]
    res = od.fn(*args, *s.scalars)
    if not s.inputs and out.dims:  # a fill: the whole output buffer
        res = res.expand([program.dim(d).size for d in out.dims])
    return _Value(res.to(out.dtype), out.dims)


def _split_axis(v: _Value, dim: str, cores: int, size: int, chunk: int, pad: float) -> _Value:
    """Split axis ``dim`` into (cores, per-core chunk); the core axis goes first."""
    ax = v.dims.index(dim)
    t = v.t
    if chunk * cores != size:
        padding = [0, 0] * (t.dim() - ax - 1) + [0, chunk * cores - size]
        t = torch.nn.functional.pad(t, padding, value=pad)
    t = t.unflatten(ax, (cores, chunk)).movedim(ax, 0)
    return _Value(t, (_P + dim,) + v.dims)


def _matmul(program: Program, s: Matmul, env: dict[str, _Value]) -> _Value:
    a, b = env[s.a], env[s.b]
    out = program.buffer(s.out)
    k = [d for d in a.dims if d in b.dims and d not in out.dims]
    split = [d for d in k if program.dim(d).cores > 1]
    for d in split:
        dd = program.dim(d)
        a = _split_axis(a, d, dd.cores, dd.size, dd.core_extent, 0.0)
        b = _split_axis(b, d, dd.cores, dd.size, dd.core_extent, 0.0)
    # fp32 accumulation like the PE array; einsum lowers to one (batched) GEMM
    letters = {d: chr(ord("a") + i) for i, d in enumerate(dict.fromkeys(a.dims + b.dims))}
    partial = tuple(_P + d for d in split)
    out_dims = partial + out.dims
    eq = (
        "".join(letters[d] for d in a.dims)
        + ","
        + "".join(letters[d] for d in b.dims)
        + "->"
        + "".join(letters[d] for d in out_dims)
    )
    acc = _acc_dtype(out.dtype) if out.dtype.is_floating_point else torch.float32
    r = torch.einsum(eq, a.t.to(torch.float32), b.t.to(torch.float32))
    return _Value(r.to(acc if partial else out.dtype), out_dims)


def _reduce(program: Program, s: Reduce, env: dict[str, _Value]) -> _Value:
    v = env[s.input]
    rd = ops_mod.reduction(s.op)
    out = program.buffer(s.out)
    t = v.t.to(torch.float32) if v.t.is_floating_point() else v.t
    v = _Value(t, v.dims)
    dd = program.dim(s.dim)
    if dd.cores > 1:
        v = _split_axis(v, s.dim, dd.cores, dd.size, dd.core_extent, rd.identity)
    r = rd.fn(v.t, v.dims.index(s.dim))
    rest = tuple(d for d in v.dims if d != s.dim)
    partial = tuple(d for d in rest if d.startswith(_P))
    val = _Value(r, rest)
    dims = partial + out.dims
    res = val.aligned(dims)
    return _Value(res if partial else res.to(out.dtype), dims)


def _allreduce(program: Program, s: RingAllReduce, v: _Value) -> _Value:
    rd = ops_mod.reduction(s.op)
    ax = v.dims.index(_P + s.dim)
    r = rd.fn(v.t, ax)
    dims = v.dims[:ax] + v.dims[ax + 1 :]
    buf = program.buffer(s.buffer)
    if not any(d.startswith(_P) for d in dims):
        r = r.to(buf.dtype)
    return _Value(r, dims)
