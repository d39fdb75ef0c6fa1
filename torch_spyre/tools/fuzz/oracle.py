"""The reference and its tolerances: what counts as a mismatch.

The reference is the graph run on the CPU in float32 (``cpu``), the same
code as on spyre.  How far another float32 implementation may honestly
differ from it depends on the graph: a chain of element-wise ops on O(1)
values agrees to a few ulps, a sum of 4000 terms or a layer norm of a row
with little variance much less closely.  Each output's tolerance is measured
rather than guessed, by **noise injection** (Monte Carlo arithmetic, as in
CADNA/Verrou):

* the graph runs in float64 (``exact``; 16-bit casts become float64 too);
* it runs again ``NOISE_RUNS`` times with every rounding an implementation
  may make modelled as random noise: each op that rounds gets its operands
  perturbed by up to one ulp of its dtype (float32: 2^-23 relative;
  float16: 2^-10; its internal roundings: a norm's mean and variance, a
  softmax's max and sum; a layer norm's row also shifted as a whole by one
  rounding of its mean), and its result as well, a result accumulated over
  ``n`` terms (sums, means, contractions, cumsums, softmax and norm rows) by
  ``sqrt(n)`` ulps of its largest operand (the typical error of a sum in
  another order); ops that move data or select (views, gathers, cat, pad,
  max, relu, where) round nothing;
* ``spread`` is the largest deviation of a noisy run from ``exact``, and
  ``err32`` that of the CPU float32 run;
* ``atol = SAFETY * max(spread, err32) + ulp(max |exact|)`` and ``rtol = 0``.

So a well-conditioned output (most) is compared at a few tens of ulps, and
an output whose value is sensitive to last-bit differences gets the slack
its sensitivity needs, measured on this graph and these inputs, never a
blanket one.  An output whose tolerance exceeds ``ILL_CONDITIONED`` of its
magnitude is counted as ill-conditioned (still compared, at that
tolerance).  Integer and boolean outputs (argmax, index arithmetic, masks)
must be equal.

``SAFETY = 16``: the noise runs sample rounding errors, the spyre kernels
make their own (different summation orders across cores and tiles, fp32
partial sums, their own transcendental functions), a few times the sampled
spread; measured over the CI seed set, the largest ratio of a passing
output's spyre error to ``max(spread, err32)`` is quoted in docs/compiler.md
("The fuzzer").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch_spyre.tools.fuzz.graph import ULP, Graph

NOISE_RUNS = 2
SAFETY = 16.0
ILL_CONDITIONED = 1e-3

#: ops that never round: their result is a selection of their operands
_EXACT_OPS = {"view", "slice", "cat", "rotate_half", "pad", "where"}
_EXACT_UNARY = {"neg", "abs", "relu", "clamp", "hardtanh"}
_EXACT_REDUCE = {"amax", "amin", "max_values", "argmax", "argmin"}


def _rounds(n) -> bool:
    if n.op in _EXACT_OPS:
        return False
    if n.op == "unary":
        return n.attrs["f"] not in _EXACT_UNARY
    if n.op == "reduce":
        return n.attrs["f"] not in _EXACT_REDUCE
    if n.op == "misc":
        return n.attrs["kind"] == "cumsum"
    if n.op == "index":
        return n.attrs["kind"] in ("scatter_add", "index_add")
    if n.op == "select":
        return False
    if n.op == "write":
        return n.attrs["kind"] == "index_put_acc"
    if n.op == "route":
        return n.attrs["kind"] in ("scatter_add", "index_add")
    if n.op == "conv":
        return n.attrs["kind"] != "maxpool"
    if n.op == "cast":
        return n.attrs["to"] == "float16"
    return True


def build(graph: Graph, hook: bool = False) -> tuple:
    """``(fn, make_inputs)`` from the graph's source; with ``hook`` the
    reference's float64 variant, calling ``_h`` on every computed value."""
    src = graph.input_source() + graph.source(hook=hook)
    if hook:
        src = src.replace("torch.float16", "torch.float64").replace(
            "torch.float32", "torch.float64"
        )
    ns: dict = {"torch": torch, "F": F}
    exec(compile(src, f"<fuzz graph seed={graph.seed}>", "exec"), ns)
    return ns["fn"], ns["make_inputs"], ns


@dataclass
class Reference:
    cpu: list[torch.Tensor]
    exact: list[torch.Tensor]
    atol: list[float]
    #: max(spread, err32) per output (the measured error scale)
    scale: list[float]
    ill: list[bool]


def _to64(t):
    return t.to(torch.float64) if t.is_floating_point() else t


def _maxabs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _mean_rounding(x: torch.Tensor, k: int, ulp: float, gen) -> torch.Tensor:
    """``x`` shifted by one rounding of its row mean (over the last ``k``
    dims), the same shift for the whole row: a layer norm subtracts one mean
    from every element, so its rounding moves the row coherently.  Per-element
    noise alone misses that: a row of equal values normalises to rounding
    noise over sqrt(eps), and a contraction of it sums the row's error
    coherently, K times instead of sqrt(K) (fuzzer seeds 905416-905419: a
    layer norm of an expanded input times its transpose, 16.8x the sampled
    spread on the card, whose mean of 32 equal fp32 values is one ulp off)."""
    dims = tuple(range(x.dim() - k, x.dim()))
    mean = x.mean(dims, keepdim=True)
    u = torch.rand(mean.shape, generator=gen, dtype=torch.float64) * 2 - 1
    return x + mean.abs() * ulp * u


def reference(graph: Graph, inputs: list[torch.Tensor], runs: int = NOISE_RUNS) -> Reference:
    """The CPU float32 outputs and each output's tolerance (module doc)."""
    fn, _, _ = build(graph)
    with torch.no_grad():
        cpu = list(fn(*inputs))
    fn64, _, ns = build(graph, hook=True)
    ins64 = [_to64(t) for t in inputs]
    ns["_h"] = lambda i, f, *a: f(*a)
    with torch.no_grad():
        exact = [o.detach() for o in fn64(*ins64)]
    spread = [0.0] * len(exact)
    nodes = graph.nodes
    for r in range(runs):
        gen = torch.Generator().manual_seed(1000 + r)

        def noise(v: torch.Tensor, rel: float, extra: float = 0.0, gen=gen) -> torch.Tensor:
            if not v.is_floating_point():
                return v
            u = torch.rand(v.shape, generator=gen, dtype=torch.float64) * 2 - 1
            return v + (v.abs() * rel + extra) * u

        def hook(i, f, *args, noise=noise, gen=gen):
            n = nodes[i]
            if not (n.is_float and _rounds(n)):
                return f(*args)
            ulp = ULP[n.dtype]
            if n.op == "norm" and n.attrs.get("kind") == "layer":
                args = (_mean_rounding(args[0], n.attrs["k"], ulp, gen), *args[1:])
            # the op's own intermediate roundings (a norm's mean and variance,
            # a softmax's max and sum) act like a perturbation of its operands
            v = f(*(noise(a, ulp) for a in args))
            extra = 0.0
            if n.acc > 1:
                mag = max((_maxabs(a) for a in args if a.is_floating_point()), default=0.0)
                extra = ulp * math.sqrt(n.acc) * mag
            return noise(v, ulp, extra)

        ns["_h"] = hook
        with torch.no_grad():
            outs = fn64(*ins64)
        for k, (o, e) in enumerate(zip(outs, exact)):
            if o.is_floating_point():
                spread[k] = max(spread[k], _maxabs(o - e))
    atol, scale, ill = [], [], []
    for c, e, s in zip(cpu, exact, spread):
        if not c.is_floating_point():
            atol.append(0.0)
            scale.append(0.0)
            ill.append(False)
            continue
        err32 = _maxabs(c.to(torch.float64) - e)
        sc = max(s, err32)
        mag = _maxabs(e)
        ulp = ULP["float16" if c.dtype == torch.float16 else "float32"]
        atol.append(SAFETY * sc + ulp * mag)
        scale.append(sc)
        ill.append(SAFETY * sc > ILL_CONDITIONED * max(1.0, mag))
    return Reference(cpu, exact, atol, scale, ill)


def compare(got: torch.Tensor, ref: Reference, k: int) -> tuple[bool, str, float]:
    """Output ``k`` against the reference: (ok, message, error / scale)."""
    want = ref.cpu[k]
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return (
            False,
            f"output {k}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}",
            math.inf,
        )
    got = got.detach().cpu()
    if not want.is_floating_point():
        if torch.equal(got, want):
            return True, "", 0.0
        bad = int((got != want).sum())
        return (
            False,
            f"output {k}: {bad} of {want.numel()} elements differ ({want.dtype})",
            math.inf,
        )
    if not torch.isfinite(got).all():
        return False, f"output {k}: non-finite values", math.inf
    err = _maxabs(got.to(torch.float64) - want.to(torch.float64))
    ratio = err / ref.scale[k] if ref.scale[k] > 0 else (0.0 if err == 0 else math.inf)
    if err <= ref.atol[k]:
        return True, "", ratio
    return (
        False,
        f"output {k} {want.dtype}{tuple(want.shape)}: max abs error {err:.3g} > atol {ref.atol[k]:.3g} "
        f"(error scale {ref.scale[k]:.3g}, max |value| {_maxabs(want):.3g})",
        ratio,
    )


__all__ = ["ILL_CONDITIONED", "NOISE_RUNS", "SAFETY", "Reference", "build", "compare", "reference"]
