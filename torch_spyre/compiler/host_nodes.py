"""The last degrade step: a node computed on the host from Inductor's own IR.

A node no kernel program expresses runs as eager kernels when its buffer
maps to FX nodes (``eager_nodes.py``).  Some buffers have none: Inductor
realized them inside another op's lowering (the materialised input of a
reduction, a reshape of a permuted mean).  Their only description is the
IR itself: a loop body over index variables (``inner_fn``) whose loads name
buffers at index expressions.  This module writes that loop body as Python
over broadcast index grids, op for op (``torch.add`` for ``ops.add``, a
gather from the input's storage for ``ops.load``), so the node runs on the
host: the counted host fallback of the degrade path (``degrade.py``), never
an aborted compile.

The generated function takes each buffer it reads as a flat copy of that
buffer's storage on the host (``runtime.compiled.run_host`` builds them, as
the IR's indices address storage) and returns the node's value in its
logical shape; the runtime copies it into the buffer Inductor allocated.
16-bit values are computed in fp32 and rounded once at the end, as the
card's vector unit does.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.common import PythonPrinter
from torch._inductor.virtualized import OpsValue, V

from torch_spyre.compiler.nodes import _simplify, _static
from torch_spyre.kernels.search import Unsupported

#: names the generated code uses (runtime.compiled.run_host provides them)
GLOBALS = ("torch", "math", "_ld", "_ldm", "_truncdiv")


class _Printer(PythonPrinter):
    """Index expressions over index-grid tensors (``min``/``max`` elementwise)."""

    def _print_Min(self, expr) -> str:
        args = [self._print(a) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = f"torch.minimum(torch.as_tensor({out}), torch.as_tensor({a}))"
        return out

    def _print_Max(self, expr) -> str:
        args = [self._print(a) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = f"torch.maximum(torch.as_tensor({out}), torch.as_tensor({a}))"
        return out


_printer = _Printer()

#: ops.<name> -> the torch function computing it elementwise
_UNARY = {
    "abs": "torch.abs", "exp": "torch.exp", "exp2": "torch.exp2", "expm1": "torch.expm1",
    "log": "torch.log", "log2": "torch.log2", "log10": "torch.log10", "log1p": "torch.log1p",
    "sqrt": "torch.sqrt", "rsqrt": "torch.rsqrt", "sin": "torch.sin", "cos": "torch.cos",
    "tan": "torch.tan", "asin": "torch.asin", "acos": "torch.acos", "atan": "torch.atan",
    "sinh": "torch.sinh", "cosh": "torch.cosh", "tanh": "torch.tanh", "asinh": "torch.asinh",
    "acosh": "torch.acosh", "atanh": "torch.atanh", "erf": "torch.erf", "erfc": "torch.erfc",
    "erfinv": "torch.erfinv", "sigmoid": "torch.sigmoid", "relu": "torch.relu",
    "floor": "torch.floor", "ceil": "torch.ceil", "trunc": "torch.trunc", "round": "torch.round",
    "sign": "torch.sign", "signbit": "torch.signbit", "neg": "torch.neg",
    "reciprocal": "torch.reciprocal", "square": "torch.square", "isinf": "torch.isinf",
    "isnan": "torch.isnan", "logical_not": "torch.logical_not",
    "bitwise_not": "torch.bitwise_not", "lgamma": "torch.lgamma", "digamma": "torch.digamma",
    "frexp": "torch.frexp", "libdevice_abs": "torch.abs", "libdevice_exp": "torch.exp",
    "libdevice_log": "torch.log", "libdevice_sqrt": "torch.sqrt", "libdevice_sin": "torch.sin",
    "libdevice_cos": "torch.cos", "libdevice_sigmoid": "torch.sigmoid",
}  # fmt: skip
_BINARY = {
    "add": "torch.add", "sub": "torch.sub", "mul": "torch.mul", "truediv": "torch.true_divide",
    "div": "torch.true_divide", "int_truediv": "torch.true_divide",
    "floordiv": "torch.floor_divide", "remainder": "torch.remainder", "mod": "torch.fmod",
    "fmod": "torch.fmod", "pow": "torch.pow", "minimum": "torch.minimum",
    "maximum": "torch.maximum", "eq": "torch.eq", "ne": "torch.ne", "lt": "torch.lt",
    "le": "torch.le", "gt": "torch.gt", "ge": "torch.ge", "logical_and": "torch.logical_and",
    "logical_or": "torch.logical_or", "logical_xor": "torch.logical_xor",
    "bitwise_and": "torch.bitwise_and", "bitwise_or": "torch.bitwise_or",
    "bitwise_xor": "torch.bitwise_xor", "bitwise_left_shift": "torch.bitwise_left_shift",
    "bitwise_right_shift": "torch.bitwise_right_shift", "atan2": "torch.atan2",
    "hypot": "torch.hypot", "copysign": "torch.copysign", "nextafter": "torch.nextafter",
    "fmax": "torch.fmax", "fmin": "torch.fmin", "and_": "torch.bitwise_and",
    "or_": "torch.bitwise_or", "xor": "torch.bitwise_xor", "lshift": "torch.bitwise_left_shift",
    "rshift": "torch.bitwise_right_shift", "truncdiv": "_truncdiv",
}  # fmt: skip
_NO_OPS = ("check_bounds", "device_assert_async")
_WIDE = (torch.float16, torch.bfloat16)


def _scalar(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "math.nan"
        if math.isinf(value):
            return "math.inf" if value > 0 else "-math.inf"
    return repr(value)


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _WIDE else dtype


class _Writer:
    """An ops handler writing each op of a loop body as one Python line."""

    def __init__(self, reads: dict[str, str]):
        self.lines: list[str] = []
        self.reads = reads  # buffer name -> parameter name
        self.count = 0
        self.masked_depth = 0

    def _new(self, expr: str) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {expr}")
        return name

    def _arg(self, a: Any) -> str:
        if isinstance(a, OpsValue):
            a = a.value
        if isinstance(a, str):
            return a
        if isinstance(a, bool | int | float):
            return _scalar(a)
        if isinstance(a, sympy.Expr):
            return self._index(a)
        raise Unsupported(f"spyre compiler: host code for an operand {type(a).__name__}")

    def _index(self, expr) -> str:
        # size symbols (automatic dynamic shapes) specialised, with a guard
        expr = _simplify(sympy.sympify(expr))
        return _printer.doprint(expr)

    def __getattr__(self, op: str):
        if op in _UNARY:
            return lambda x: self._new(f"{_UNARY[op]}({self._arg(x)})")
        if op in _BINARY:

            def binary(a, b):
                a, b = self._arg(a), self._arg(b)
                return self._new(f"{_BINARY[op]}(torch.as_tensor({a}), torch.as_tensor({b}))")

            return binary
        if op in _NO_OPS:
            return lambda *a, **k: None
        raise Unsupported(f"spyre compiler: no host code for ops.{op}")

    # -- values --------------------------------------------------------
    def constant(self, value, dtype):
        return self._new(f"torch.tensor({_scalar(value)}, dtype={_compute(dtype)})")

    def index_expr(self, expr, dtype):
        return self._new(f"torch.as_tensor({self._index(expr)}).to({dtype})")

    def load(self, name: str, index):
        param = self.reads.get(name)
        if param is None:  # a buffer a read of an in-place op's result stands for
            if name not in V.graph.name_to_buffer and name not in V.graph.graph_inputs:
                raise Unsupported(f"spyre compiler: host code reads {name}, an unknown buffer")
            param = self.reads[name] = f"in{len(self.reads)}"
        loader = "_ldm" if self.masked_depth else "_ld"  # masked: lanes it drops may be outside
        return self._new(f"{loader}({param}, {self._index(index)})")

    def to_dtype(self, x, dtype, src_dtype=None, use_compute_types=True):
        return self._new(f"{self._arg(x)}.to({_compute(dtype)})")

    def to_dtype_bitcast(self, x, dtype, src_dtype):
        return self._new(f"{self._arg(x)}.to({src_dtype}).view({dtype}).to({_compute(dtype)})")

    def where(self, c, a, b):
        a, b = self._arg(a), self._arg(b)
        return self._new(f"torch.where({self._arg(c)}, torch.as_tensor({a}), torch.as_tensor({b}))")

    def masked(self, mask, body, other):
        self.masked_depth += 1
        try:
            value = body()
        finally:
            self.masked_depth -= 1
        return self._new(
            f"torch.where({self._arg(mask)}, torch.as_tensor({self._arg(value)}), "
            f"torch.as_tensor({_scalar(other)}))"
        )

    def indirect_indexing(self, x, size, check=True, wrap_neg=True):
        name = self._new(f"{self._arg(x)}.long()")
        if wrap_neg:
            size = _static([size], "an index")[0]
            self.lines.append(f"{name} = torch.where({name} < 0, {name} + {size}, {name})")
        return sympy.Symbol(name, integer=True)

    def identity(self, x):
        return x

    def store(self, name, index, value, mode=None):
        if mode not in (None, "atomic_add"):
            raise Unsupported(f"spyre compiler: no host code for a {mode} store")
        self.stored = (self._arg(value), self._index(index))
        self.mode = mode

    def reduction(self, dtype, src_dtype, reduction_type, value):
        return _reduce(self, reduction_type, self._arg(value), self.full, self.npoint)

    def store_reduction(self, name, index, value):
        self.stored = (self._arg(value), self._index(index))


def _grid(names: list[str], sizes: list[int]) -> list[str]:
    n = len(sizes)
    lines = []
    for k, (name, size) in enumerate(zip(names, sizes)):
        shape = [1] * n
        shape[k] = size
        lines.append(f"{name} = torch.arange({size}).view({shape})")
    return lines


def _reduce(w: _Writer, kind: str, value: str, full: list[int], npoint: int):
    """Reduce ``value`` (a grid over pointwise then reduction dims) over its
    reduction dims; a welford reduction gives (mean, M2, count)."""
    v = w._new(f"torch.as_tensor({value}).expand({full}).reshape({full[:npoint] + [-1]})")
    if kind == "sum":
        return w._new(f"{v}.sum(-1)")
    if kind == "prod":
        return w._new(f"{v}.prod(-1)")
    if kind == "max":
        return w._new(f"{v}.amax(-1)")
    if kind == "min":
        return w._new(f"{v}.amin(-1)")
    if kind == "any":
        return w._new(f"{v}.any(-1)")
    if kind in ("argmax", "argmin"):
        return w._new(f"{v}.{kind}(-1)")
    if kind == "welford_reduce":
        mean = w._new(f"{v}.double().mean(-1)")
        return (
            w._new(f"{mean}.float()"),
            w._new(f"(({v}.double() - {mean}[..., None]) ** 2).sum(-1).float()"),
            w._new(f"torch.full({full[:npoint]}, float({v}.shape[-1]))"),
        )
    raise Unsupported(f"spyre compiler: no host code for a {kind} reduction")


def function_source(snode) -> tuple[str, str, list[str]]:
    """(name, Python source computing ``snode``'s buffer on the host from the
    storage of the buffers it reads, the wrapper variables to call it with).
    Unsupported for IR this writer does not cover (scatters, scans, sorts)."""
    buf = snode.node
    name = buf.get_name()
    data = getattr(buf, "data", None)
    if not isinstance(buf, ir.ComputedBuffer) or type(data) not in (
        ir.Pointwise,
        ir.Scatter,
        ir.Reduction,
        ir.WelfordReduction,
    ):
        raise Unsupported(f"spyre compiler: no host code for {name} ({type(data).__name__})")
    # symbolic sizes (automatic dynamic shapes) specialised, with a guard
    ranges = _static(data.ranges, name)
    rranges = _static(getattr(data, "reduction_ranges", ()), name)
    params: dict[str, str] = {}  # buffer -> parameter, in the order loads read them
    # a buffer written in place by a scatter is held under that one's name
    scheduler = V.graph.scheduler
    real = getattr(scheduler, "mutation_real_name", {}) if scheduler else {}
    w = _Writer(params)
    inames = [f"i{k}" for k in range(len(ranges))]
    rnames = [f"r{k}" for k in range(len(rranges))]
    isyms = [sympy.Symbol(n, integer=True, nonnegative=True) for n in inames]
    rsyms = [sympy.Symbol(n, integer=True, nonnegative=True) for n in rnames]
    full = ranges + rranges
    w.full, w.npoint, w.stored, w.mode = full, len(ranges), None, None
    w.lines.extend(_grid(inames + rnames, full))
    with V.set_ops_handler(w):
        store = buf.get_store_function()
        if rranges or type(data) not in (ir.Pointwise, ir.Scatter):
            store(isyms, rsyms)
        else:
            store(isyms)
    if w.stored is None:
        raise Unsupported(f"spyre compiler: no host code for {name}: it stores nothing")
    value, index = w.stored
    lead = ranges + [1] * len(rranges)
    reads = list(params)
    dtype = buf.get_dtype()
    body = "\n".join(f"    {ln}" for ln in w.lines)
    src = (
        f"def forward({', '.join(params[r] for r in reads)}):\n{body}\n"
        f"    value = torch.as_tensor({value}).to({dtype}).expand({ranges})\n"
        f"    index = torch.as_tensor({index}).expand({lead}).reshape({ranges})\n"
        f"    return value, index, {w.mode!r}\n"
    )
    try:
        compile(src, "<spyre host node>", "exec")
    except SyntaxError as err:
        raise Unsupported(f"spyre compiler: host code for {name} does not compile: {err}") from None
    digest = hashlib.sha256(src.encode()).hexdigest()[:12]
    return f"_spyre_host_{digest}", src, [real.get(r, r) for r in reads]


__all__ = ["GLOBALS", "function_source"]
