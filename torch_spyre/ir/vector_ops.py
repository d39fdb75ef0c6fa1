"""The vocabulary of compute steps: op name -> torch function and cost class.

Producers name ops by string in kernel programs; the executor looks the
function up here and the timing model the cost class.  The table below is
every op a kernel builder or the compiler names; the eager layer adds one op
per aten overload and static arguments it runs (named ``aten.*``, through
``register_op``).  A program naming an unknown op is rejected at validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VectorOpDef:
    name: str
    fn: Callable[..., torch.Tensor]
    #: "simple" | "transcendental" (see HardwareConfig.sfu_*_cycles)
    cost_class: str
    #: tensor inputs it takes; scalars come after them
    num_inputs: int
    #: FLOP counted per output element (for rooflines and reports)
    flops: float = 1.0
    #: ``fn`` writing into ``out=`` (same numbers, no temporary), if it has one
    out_fn: Callable[..., torch.Tensor] | None = None


@dataclass(frozen=True)
class ReductionDef:
    name: str
    fn: Callable[[torch.Tensor, int], torch.Tensor]
    #: value that does not change the result (pads uneven core splits)
    identity: float
    #: vector-op cost classes each input stick pays on top of the reduction
    #: itself (an online log-sum-exp: subtract the running max, exp, rescale)
    extra_cost: tuple[str, ...] = ()


# Ops the vector unit evaluates with its transcendental path (a table lookup /
# iteration per element); everything else is one simple vector operation.
TRANSCENDENTAL = {
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "erfc",
    "erfinv", "sqrt", "rsqrt", "reciprocal", "div", "pow", "silu", "gelu", "elu", "selu",
    "celu", "mish", "softplus", "logit", "atan", "atan2", "asinh", "acosh", "atanh", "sinh",
    "cosh", "asin", "acos", "lgamma", "digamma", "polygamma", "hardswish", "log_sigmoid_forward",
    "xlogy", "logaddexp", "logaddexp2", "true_divide", "fmod", "remainder", "i0", "sinc",
    "igamma", "igammac", "nextafter", "frexp", "ldexp", "hypot", "copysign",
}  # fmt: skip


VECTOR_OPS: dict[str, VectorOpDef] = {}
REDUCTIONS: dict[str, ReductionDef] = {}


def register_op(
    name: str,
    fn: Callable[..., torch.Tensor],
    cost_class: str,
    num_inputs: int,
    flops: float = 1.0,
    out_fn: Callable[..., torch.Tensor] | None = None,
) -> None:
    if cost_class not in ("simple", "transcendental"):
        raise ValueError(f"cost_class must be 'simple' or 'transcendental', got {cost_class!r}")
    VECTOR_OPS[name] = VectorOpDef(name, fn, cost_class, num_inputs, flops, out_fn)


def register_reduction(
    name: str,
    fn: Callable[[torch.Tensor, int], torch.Tensor],
    identity: float,
    extra_cost: tuple[str, ...] = (),
) -> None:
    for c in extra_cost:
        if c not in ("simple", "transcendental"):
            raise ValueError(f"extra_cost classes must be 'simple' or 'transcendental', got {c!r}")
    REDUCTIONS[name] = ReductionDef(name, fn, identity, tuple(extra_cost))


def aten_unary(name: str) -> str | None:
    """The vector op computing ``aten.<name>`` of one tensor (an op Inductor's
    loop IR names, ``ops.acos``), evaluated as the eager library evaluates
    its pointwise ops (cost class from ``TRANSCENDENTAL``); None when aten
    has no such unary pointwise op.  Programs name it ``aten.<name>:unary``,
    which ``vector_op`` resolves in any process (a program from a cache)."""
    packet = getattr(torch.ops.aten, name, None)
    op = getattr(packet, "default", None) if packet is not None else None
    if op is None or torch.Tag.pointwise not in op.tags:
        return None
    args = op._schema.arguments
    if (
        not args
        or str(args[0].type) != "Tensor"
        or any(not a.has_default_value() for a in args[1:])
    ):
        return None
    key = f"aten.{name}:unary"
    if key not in VECTOR_OPS:
        out = getattr(packet, "out", None)
        out_fn = (lambda x, *, out, _o=out: _o(x, out=out)) if out is not None else None
        cost = "transcendental" if name in TRANSCENDENTAL else "simple"
        register_op(key, op, cost, 1, out_fn=out_fn)
    return key


def vector_op(name: str) -> VectorOpDef:
    if name not in VECTOR_OPS and name.startswith("aten.") and name.endswith(":unary"):
        aten_unary(name[len("aten.") : -len(":unary")])
    try:
        return VECTOR_OPS[name]
    except KeyError:
        raise KeyError(
            f"unknown vector op {name!r}; known: {', '.join(sorted(VECTOR_OPS))}. "
            f"Add it to the table in torch_spyre/ir/vector_ops.py."
        ) from None


def reduction(name: str) -> ReductionDef:
    try:
        return REDUCTIONS[name]
    except KeyError:
        raise KeyError(
            f"unknown reduction {name!r}; known: {', '.join(sorted(REDUCTIONS))}"
        ) from None


_S, _T = "simple", "transcendental"
for _name, _fn, _cls, _n in [
    ("add", torch.add, _S, 2),
    ("sub", torch.sub, _S, 2),
    ("mul", torch.mul, _S, 2),
    ("maximum", torch.maximum, _S, 2),
    ("minimum", torch.minimum, _S, 2),
    ("div", torch.div, _T, 2),  # a reciprocal (transcendental class) + mul
    ("neg", torch.neg, _S, 1),
    ("abs", torch.abs, _S, 1),
    ("relu", torch.relu, _S, 1),
    ("square", torch.square, _S, 1),
    ("copy", lambda x: x, _S, 1),
    ("exp", torch.exp, _T, 1),
    ("log", torch.log, _T, 1),
    ("tanh", torch.tanh, _T, 1),
    ("sigmoid", torch.sigmoid, _T, 1),
    ("silu", torch.nn.functional.silu, _T, 1),
    ("gelu", torch.nn.functional.gelu, _T, 1),
    ("sqrt", torch.sqrt, _T, 1),
    ("rsqrt", torch.rsqrt, _T, 1),
    ("reciprocal", torch.reciprocal, _T, 1),
    # with one scalar after the tensor: x + s, x * s, ...
    ("add_scalar", torch.add, _S, 1),
    ("mul_scalar", torch.mul, _S, 1),
    ("pow_scalar", torch.pow, _T, 1),
]:
    register_op(_name, _fn, _cls, _n)

register_reduction("sum", lambda x, d: x.sum(d), 0.0)
register_reduction("max", lambda x, d: x.amax(d), -math.inf)
register_reduction("min", lambda x, d: x.amin(d), math.inf)

# the flash-attention program (kernels/flash.py) and the compiler's lowering
for _name, _fn, _cls, _n in [
    # no buffer input: fills its whole output buffer with the scalar
    ("fill", lambda v: torch.tensor(v, dtype=torch.float32), _S, 0),
    ("le", torch.le, _S, 2),
    # x where keep, else the scalar (a masked select: one pass per stick)
    ("keep_or_fill", lambda x, keep, v: torch.where(keep.bool(), x, v), _S, 2),
    ("erf", torch.erf, _T, 1),
    ("maximum_scalar", lambda x, s: torch.clamp_min(x, s), _S, 1),
    ("minimum_scalar", lambda x, s: torch.clamp_max(x, s), _S, 1),
    ("where", torch.where, _S, 3),
    ("lt", torch.lt, _S, 2),
    ("gt", torch.gt, _S, 2),
    ("ge", torch.ge, _S, 2),
    ("eq", torch.eq, _S, 2),
    ("ne", torch.ne, _S, 2),
    ("logical_and", torch.logical_and, _S, 2),
    ("logical_or", torch.logical_or, _S, 2),
    ("logical_not", torch.logical_not, _S, 1),
    ("pow", torch.pow, _T, 2),
    ("log1p", torch.log1p, _T, 1),
    ("expm1", torch.expm1, _T, 1),
    ("sign", torch.sign, _S, 1),
    # T5's fp16 overflow guard: isinf(x).any() picks the clamp bound
    ("isinf", torch.isinf, _S, 1),
    # range reduction of sin/cos (compiler/trig.py)
    ("round", torch.round, _S, 1),
    # modular index arithmetic (a rolled sliding-window cache): a division
    ("fmod", torch.fmod, _T, 2),
    ("remainder", torch.remainder, _T, 2),
    ("isnan", torch.isnan, _S, 1),
    # the first input repeated along the dims of the second (which only gives shape)
    ("bcast", lambda a, b: torch.broadcast_tensors(a, b)[0], _S, 2),
    # a tile already in LX read under another dim name of the same size (a
    # matmul's operand, whole along its k, read again by the epilogue along
    # an output dim: RoPE's q @ rotation, then q * cos; kernels/plan.py):
    # the input's one dim the output lacks is the output's one dim it lacks
    ("rename", lambda x: x, _S, 1),
    # RoPE's rotate_half over a size-2 dim (``Vector.dim``) of a buffer, the
    # halves of a head: ``cat(-x[1], x[0])``, whole sticks moved and negated
    # (the dim is never the stick dim; sim/executor.py computes it)
    ("rotate_half", lambda x: x, _S, 1),
    # rounding (Llama-4 / Ministral attention temperature: floor(pos / n))
    ("floor", torch.floor, _S, 1),
    ("ceil", torch.ceil, _S, 1),
    ("trunc", torch.trunc, _S, 1),
    # integer division (inputs within the exact range, sim/executor.check_ints):
    # an fp32 division, rounded, and one multiply-subtract fix-up
    ("floordiv", torch.floor_divide, _T, 2),
    ("truncdiv", lambda a, b: torch.div(a, b, rounding_mode="trunc"), _T, 2),
]:
    register_op(_name, _fn, _cls, _n)

register_reduction("any", lambda x, d: x.bool().any(d), 0.0)
# an RMS norm's sum of squares (the fused MLP's norm prologue,
# kernels/swiglu.py): per input stick a square, then the accumulation
register_reduction("sumsq", lambda x, d: x.square().sum(d), 0.0, extra_cost=("simple",))
register_reduction("prod", lambda x, d: x.prod(d), 1.0)
# online softmax statistics of a streamed row (kernels/rewrites.py,
# ``_online_softmax``): a running max m and sum s, rescaled by
# exp(m_old - m_new) per tile; per input stick: max, subtract, exp, accumulate
register_reduction(
    "logsumexp",
    lambda x, d: torch.logsumexp(x, d),
    -math.inf,
    extra_cost=("simple", "simple", "transcendental"),
)
