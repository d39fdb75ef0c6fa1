"""Every pointwise aten op as one vector-unit kernel program.

PyTorch tags its elementwise ops ``torch.Tag.pointwise``; each such op with
tensor inputs of one output runs here: the tensor arguments become program
operands (broadcast by the program), every other argument (numbers, wrapped
0-dim host tensors, strings like ``approximate='tanh'``) is bound into the
vector op the program names.  The vector unit computes 16-bit inputs in fp32
and rounds once, like the CPU reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torch_spyre import _C
from torch_spyre.ir import vector_ops as sim_ops
from torch_spyre.ir.vector_ops import TRANSCENDENTAL, VECTOR_OPS
from torch_spyre.kernels import eager as programs
from torch_spyre.layout import FP8_DTYPES, SUPPORTED_DTYPES
from torch_spyre.ops import errors
from torch_spyre.runtime import cards, launch, operands, scalars


def _base(op) -> str:
    return op._schema.name.split("::")[-1].rstrip("_")


#: elementwise ops that PyTorch does not tag pointwise (on some overloads)
_UNTAGGED = {"hardswish", "where", "copysign", "_prelu_kernel", "rsub", "floor_divide"}


def is_pointwise(op) -> bool:
    if torch.Tag.pointwise in op.tags or _base(op) in _UNTAGGED:
        return True
    func = _functional(op)  # gelu.out is untagged, gelu.default is not
    return func is not None and torch.Tag.pointwise in func.tags


class _Slot:
    """Where a tensor operand sits in the call template."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<in{self.i}>"


def _static_repr(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # a wrapped host scalar
        return ("tensor", v.dtype, _static_repr(v.item()))
    if isinstance(v, float):  # by bits: -0.0 is not 0.0, nan is nan
        return ("f", v.hex())
    if isinstance(v, bool | int):  # x + True is not x + 1 (True == 1)
        return (type(v).__name__, v)
    return v


def _register_vector_op(op, template: list, spec: tuple[int, tuple[str, ...]], key) -> str:
    name = f"aten.{op}:{hash(key) & 0xFFFFFFFFFFFF:x}"
    if name in VECTOR_OPS:
        return name
    slots = [i for i, v in enumerate(template) if isinstance(v, _Slot)]
    nargs, kwnames = spec

    out_op = _out_overload(op)
    out_fn = None
    if not kwnames and slots == list(range(len(template))):

        def fn(*tensors: torch.Tensor) -> torch.Tensor:  # only tensors, in order
            return op(*tensors)

        if out_op is not None:

            def out_fn(*tensors: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
                return out_op(*tensors, out=out)

    else:

        def fn(*tensors: torch.Tensor) -> torch.Tensor:
            flat = list(template)
            for pos, t in zip(slots, tensors):
                flat[pos] = t
            return op(*flat[:nargs], **dict(zip(kwnames, flat[nargs:])))

        if out_op is not None:

            def out_fn(*tensors: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
                flat = list(template)
                for pos, t in zip(slots, tensors):
                    flat[pos] = t
                return out_op(*flat[:nargs], **dict(zip(kwnames, flat[nargs:])), out=out)

    cost = "transcendental" if _base(op) in TRANSCENDENTAL else "simple"
    sim_ops.register_op(name, fn, cost, len(slots), out_fn=out_fn)
    return name


def _out_overload(func):
    """The ``out=`` overload of functional ``func`` (add.Tensor -> add.out): its
    arguments plus one keyword-only ``out``; None when there is none."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1], None)
    for name in packet.overloads() if packet is not None else ():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        if (
            len(written) == 1
            and written[0].name == "out"
            and written[0].kwarg_only
            and len(cand._schema.returns) == 1
            and [(a.name, str(a.type)) for a in args if a is not written[0]] == want
        ):
            return cand
    return None


class _Plan:
    """What run() needs to know about an overload, worked out once."""

    __slots__ = ("func", "out_name", "out_pos", "out_kwarg_only", "name")

    def __init__(self, op) -> None:
        schema = op._schema
        mutable = [
            a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        ]
        self.name = str(op).removeprefix("aten.")
        self.out_name = mutable[0].name if mutable else None
        self.out_pos = [a.name for a in schema.arguments].index(self.out_name) if mutable else -1
        self.out_kwarg_only = bool(mutable) and mutable[0].kwarg_only
        # the op on the *values* of the inputs: in-place and out= ops compute
        # their functional overload and store the result
        self.func = _functional(op) if mutable else op
        if len(schema.returns) != 1 or len(mutable) > 1:
            self.func = None


_plans: dict[Any, _Plan] = {}
_IN_NAMES = tuple(f"in{i}" for i in range(64))


class _Ready:
    """A warm call: its kernel, where its input tensors sit among the arguments
    (args, then kwargs values less a keyword-only out) and where its output is."""

    __slots__ = ("kernel", "slots", "out_kw", "out_pos", "shape", "dtype", "prepared")

    def __init__(self, kernel, slots, out_kw, out_pos, shape, dtype, device) -> None:
        self.kernel, self.slots, self.shape, self.dtype = kernel, slots, shape, dtype
        self.out_kw, self.out_pos = out_kw, out_pos
        self.prepared = kernel.prepare(device.index)


#: (op, signature of each argument) -> _Ready, for calls whose arguments are
#: spyre tensors and numbers (the bulk of a model's elementwise ops)
_ready: dict[tuple, _Ready] = {}
launch.on_clear(_ready.clear)
launch.on_clear(_C._warm_clear)
# a _Ready holds its card and that card's report: rebuilt cards need new ones
cards.on_reset(_ready.clear)

#: the out= overloads PyTorch's composite add/sub/mul/div.Tensor call, by the
#: C++ warm path's op code (csrc/warm.cpp, WarmOp), and the executor's form
#: of each (sim/executor.py, _same_layout_elementwise) that the C++ repeats
_WARM = {
    "add.out": (0, "out"),
    "sub.out": (1, "out"),
    "mul.out": (2, "out"),
    "div.out": (3, "upcast"),
}


def _record_warm(plan: _Plan, ready: _Ready, template: list, tensors: list) -> None:
    """After the first launch of ``a op b`` (whole operands of one shape and
    dtype, nothing else bound): let the C++ kernels of add/sub/mul/div.Tensor
    serve the same call from now on, with this launch's modelled time."""
    warm = _WARM.get(plan.name)
    if (
        warm is None
        or ready.prepared.fast is None
        or len(tensors) != 2
        or len(template) != 2  # a scalar or keyword (alpha) is bound: Python serves it
    ):
        return
    a, b = tensors
    if (
        a.dim() == 0
        or a.shape != b.shape
        or a.dtype != b.dtype
        or ready.shape != tuple(a.shape)
        or ready.dtype != a.dtype
        or ready.prepared.form != warm[1]
    ):
        return
    code, form = warm
    rep = ready.prepared.report
    _C._warm_put(
        code, a.device.index, a.dtype, list(a.shape), rep.time_s, form == "upcast", plan.name
    )


_NUMBERS = (int, float, bool)


def _signature(op, args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a call whose arguments are tensors and numbers (type
    included: ``x + True`` is not ``x + 1``; floats by bits: -0.0 is not 0.0);
    None for anything else.  Only calls whose tensors are all on spyre are
    ever entered (a host scalar tensor's value is not in the key)."""
    sig: list = [op]
    for v in (*args, *kwargs.items()):
        if type(v) is tuple:  # a keyword argument
            sig.append(v[0])
            v = v[1]
        t = type(v)
        if t is torch.Tensor:
            sig.append(v.shape)
            sig.append(v.dtype)
            sig.append(v.device)
        elif t is float:
            sig.append(v.hex())
        elif t in _NUMBERS:
            sig.append(t)
            sig.append(v)
        else:
            return None
    return tuple(sig)


def run(op, args: tuple, kwargs: dict) -> Any:
    """Run pointwise ``op`` as a device kernel; NotImplemented if it can't be."""
    sig = _signature(op, args, kwargs)
    if sig is not None:
        ready = _ready.get(sig)
        if ready is not None:
            launch.record_hit()
            out = _launch_ready(ready, args, kwargs)
            if out is not None:
                return out
    call_args, call_kwargs = args, kwargs
    plan = _plans.get(op)
    if plan is None:
        plan = _plans[op] = _Plan(op)
    func = plan.func
    if func is None:
        return NotImplemented
    out_arg = None
    if plan.out_name is not None:
        if plan.out_kwarg_only:
            kwargs = dict(kwargs)
            out_arg = kwargs.pop(plan.out_name)
        else:
            out_arg = args[plan.out_pos] if plan.out_pos < len(args) else kwargs[plan.out_name]
    flat = (*args, *kwargs.values())  # where the fast path finds the input tensors
    args, kwargs = scalars.rewrap(func, args, kwargs)
    kwnames = tuple(kwargs)
    spec = (len(args), kwnames)
    tensors: list[torch.Tensor] = []
    template: list[Any] = []
    device = None
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.device.type == "spyre":
                if device is not None and v.device != device:
                    return NotImplemented
                device = v.device
                template.append(_Slot(len(tensors)))
                tensors.append(v)
            elif v.dim() != 0:
                return NotImplemented  # a host tensor that isn't a scalar
            else:
                template.append(v)
        elif isinstance(v, list | tuple):
            return NotImplemented  # no pointwise op of ours takes tensor lists
        else:
            template.append(v)
    if not tensors:
        return NotImplemented
    for t in (*tensors, *((out_arg,) if out_arg is not None else ())):
        if t.dtype in FP8_DTYPES:
            raise errors.fp8_arithmetic(plan.name, t.dtype)
        if t.is_complex():  # no complex arithmetic: real ops on the parts
            from torch_spyre.ops import complex_ops

            return complex_ops.run(op, call_args, call_kwargs)
    key = (
        "pw",
        func,
        tuple((t.shape, t.dtype) for t in tensors),
        # every argument, in place: `1 - x` and `x - 1` are different kernels
        tuple("T" if isinstance(v, _Slot) else _static_repr(v) for v in template),
        spec,
    )
    k = launch.kernel(key, lambda: _build(func, template, spec, tensors, key))
    if k.program is None and (not k.info or "rejected" in k.info):
        return NotImplemented
    shape, dtype = k.info["shape"], k.info["dtype"]
    if out_arg is not None and tuple(out_arg.shape) != shape:
        if not plan.out_kwarg_only:
            return NotImplemented  # in-place that would resize self: PyTorch's error
        out_arg.resize_(shape)
    if k.info["empty"]:
        return out_arg if out_arg is not None else torch.empty(shape, dtype=dtype, device=device)
    out_kw = plan.out_name if plan.out_kwarg_only else None
    out_pos = plan.out_pos if plan.out_name is not None and out_kw is None else None
    if (
        sig is not None
        and k.program is not None
        and (out_pos is None or out_pos < len(call_args))
        and all(type(v) is not torch.Tensor or v.device.type == "spyre" for v in flat)
    ):
        slots = tuple(i for i, v in enumerate(flat) if type(v) is torch.Tensor)
        if len(_ready) > 16384:
            _ready.clear()
        _ready[sig] = ready = _Ready(k, slots, out_kw, out_pos, shape, dtype, device)
        out = _launch_ready(ready, call_args, call_kwargs)
        if out is not None:
            _record_warm(plan, ready, template, tensors)
            return out
    bind = {name: operands.memory(t) for name, t in zip(_IN_NAMES, tensors)}
    # out may alias an input: the executor loads every input before it stores
    # (an out= or in-place result of another dtype is computed, then cast in)
    direct = out_arg is not None and out_arg.dtype == dtype and operands.is_whole_default(out_arg)
    if direct:
        out = out_arg
        bind["out"] = operands.device_memory(out)
    else:
        out, bind["out"] = operands.empty(shape, dtype, device)
    k.launch_memory(device.index, bind)
    if out_arg is not None and not direct:
        out_arg.copy_(out)
        return out_arg
    return out


def _launch_ready(ready: _Ready, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Launch a warm call; None when its output is not a whole tensor of the
    result's shape and dtype (the general path then handles it)."""
    if ready.out_kw is not None:
        kwargs = dict(kwargs)
        out_arg = kwargs.pop(ready.out_kw)
        flat = (*args, *kwargs.values())
    else:
        flat = (*args, *kwargs.values()) if kwargs else args
        out_arg = None if ready.out_pos is None else args[ready.out_pos]
    device = flat[ready.slots[0]].device
    if out_arg is None:
        out, out_mem = operands.empty(ready.shape, ready.dtype, device)
    else:
        out, out_mem = out_arg, _C._whole_operand(out_arg)
        if out_mem is None or out.shape != ready.shape or out.dtype != ready.dtype:
            return None
    memory = operands.memory
    bind = {name: memory(flat[i]) for name, i in zip(_IN_NAMES, ready.slots)}
    bind["out"] = out_mem
    ready.prepared.launch(bind)
    return out


def _build(func, template, spec, tensors, key) -> launch.Kernel:
    """Output metadata (from the op's meta kernel) and the program."""
    metas = iter([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors])
    flat = [next(metas) if isinstance(v, _Slot) else v for v in template]
    nargs, kwnames = spec
    margs, mkwargs = flat[:nargs], dict(zip(kwnames, flat[nargs:]))
    try:
        out_meta = func(*margs, **mkwargs)
    except Exception:
        return launch.Kernel(None)  # type: ignore[arg-type]  # PyTorch raises the error itself
    if not isinstance(out_meta, torch.Tensor) or out_meta.dtype not in SUPPORTED_DTYPES:
        return launch.Kernel(None)  # type: ignore[arg-type]
    shape = tuple(out_meta.shape)
    info = {
        "shape": shape,
        "dtype": out_meta.dtype,
        "empty": math.prod(shape) == 0 or any(t.numel() == 0 for t in tensors),
    }
    if info["empty"]:
        return launch.Kernel(None, info)  # type: ignore[arg-type]
    vop = _register_vector_op(func, template, spec, key)
    program = programs.pointwise(
        vop,
        shape,
        out_meta.dtype,
        [(tuple(t.shape), t.dtype) for t in tensors],
        name=f"{_base(func)}_{'x'.join(map(str, shape)) or 'scalar'}",
    )
    return launch.Kernel(program, info)


def _functional(op):
    """The functional overload of an in-place or out= op (add_.Tensor / add.out ->
    add.Tensor): the overload of the base name whose arguments are the op's
    arguments less the written ones."""
    key = op
    if key in _functional_cache:
        return _functional_cache[key]
    want = [
        (a.name, str(a.type))
        for a in op._schema.arguments
        if a.alias_info is None or not a.alias_info.is_write
    ]
    if not op._schema.arguments[0].kwarg_only and op._schema.arguments[0].alias_info is not None:
        want.insert(0, ("self", "Tensor"))  # in-place: self is read as well as written
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1].rstrip("_"), None)
    found = None
    for name in packet.overloads() if packet is not None else ():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if any(a.alias_info is not None and a.alias_info.is_write for a in args):
            continue
        if [(a.name, str(a.type)) for a in args] == want:
            found = cand
            break
    _functional_cache[key] = found
    return found


_functional_cache: dict = {}
