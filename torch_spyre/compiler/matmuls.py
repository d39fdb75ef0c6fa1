"""Inductor's extern matmul nodes (``mm``, ``addmm``, ``bmm``) as program steps.

``matmul_steps`` records, in a ``lowering.ProgramBuilder``, the loads of an
extern matmul's operands (a reshape of a whole buffer read in its own shape,
a transposed weight read as it lies), the PE-array contraction, the
alpha/bias epilogue and the store of its output; the scheduling plans it
alone or with the fused group after it as its epilogue (docs/compiler.md).
"""

from __future__ import annotations

import math

import sympy
import torch

from torch_spyre.compiler import graph_state, lowering
from torch_spyre.compiler.nodes import _buffer_info, _static
from torch_spyre.compiler.values import Scal
from torch_spyre.compiler.views import dim_pieces

MATMULS = (
    "extern_kernels.mm",
    "extern_kernels.addmm",
    "extern_kernels.bmm",
    "extern_kernels.baddbmm",
    "extern_kernels._scaled_mm",
)


def has_bias(kind: str) -> bool:
    """Whether an extern matmul's first input is its bias (``addmm``, ``baddbmm``)."""
    return kind.endswith(("addmm", "baddbmm"))


def _mixed_radix(pairs) -> sympy.Expr:
    """sum(v_i * prod(sizes after i)) over (variable, size) pairs, outer to inner."""
    expr, acc = sympy.Integer(0), 1
    for v, size in reversed(pairs):
        expr = expr + v * acc
        acc *= size
    return expr


def _groups(inp, vsz) -> list[list[int]]:
    """Per dim of a matmul input view, the dims of the buffer under it that it
    covers (a reshape of a whole contiguous buffer is read in its own shape, so
    nothing is re-laid); a plain view covers one dim each, except a dim that
    runs across buffer dims (a flat view of a contiguous stretch), read in the
    buffer's pieces (``views.dim_pieces``)."""
    usz, ustr, uoff, _ = _buffer_info(inp.get_name())
    lay = inp.get_layout()
    vst = _static(lay.stride, inp.get_name())
    plain = [dim_pieces(st, s, usz, ustr) or [s] for s, st in zip(vsz, vst)]
    if (
        vst != _contiguous(vsz)
        or _static([lay.offset], inp.get_name()) != [0]
        or list(ustr) != _contiguous(usz)
        or uoff
        or math.prod(usz) != math.prod(vsz)
    ):
        return plain
    rest = [u for u in usz if u != 1]
    out = []
    for v in vsz:
        g, acc = [], 1
        while acc < v and rest:
            acc *= rest[0]
            g.append(rest.pop(0))
        if acc != v and v != 1:
            return plain
        out.append(g if v != 1 else [1])
    return out


def _finer(f1: list[int], f2: list[int]) -> list[int]:
    """The finer of two factorisations of one dim (each piece of the coarser one
    a product of consecutive pieces of the finer one)."""
    fine, coarse = (f1, f2) if len(f1) >= len(f2) else (f2, f1)
    rest = list(fine)
    for c in coarse:
        acc = 1
        while acc < c and rest:
            acc *= rest.pop(0)
        if acc != c:
            return f1
    return fine


def _dim_expr(b: lowering.ProgramBuilder, factors: list[int]) -> sympy.Expr:
    """One variable per factor, combined outer to inner."""
    vs = b.new_vars("x", factors)
    return _mixed_radix(list(zip(vs, factors)))


def _contiguous(size) -> list[int]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= s
    return out[::-1]


def _view_index(b: lowering.ProgramBuilder, inp, vars_) -> tuple[str, sympy.Expr]:
    """(underlying buffer name, index expression) of an extern kernel input view."""
    lay = inp.get_layout()
    strides = _static(lay.stride, inp.get_name())
    offset = _static([lay.offset], inp.get_name())[0]
    expr = sum((v * st for v, st in zip(vars_, strides)), sympy.Integer(offset))
    return inp.get_name(), expr


def _inputs(b: lowering.ProgramBuilder) -> list[str]:
    """The buffers ``b`` loads so far, in first-load order."""
    out: list[str] = []
    for u in b.operands.values():
        if u.role == "input" and u.buffer not in out:
            out.append(u.buffer)
    return out


def _broadcast_load(b: lowering.ProgramBuilder, inp, outv, what: str):
    """A bias or scale broadcast to the output (its dims right-aligned)."""
    sz = _static(inp.get_size(), what)
    vs = outv[len(outv) - len(sz) :] if sz else []
    vs = [v if s > 1 else sympy.Integer(0) for v, s in zip(vs, sz)]
    return b.load(*_view_index(b, inp, vs))


def matmul_steps(
    b: lowering.ProgramBuilder, node, out_pieces: list[list[int]] | None = None
) -> list[str]:
    """Steps of an mm/addmm/bmm/_scaled_mm extern node: loads (and the weight's
    prologue, below), PE-array matmul, alpha/scale/bias epilogue, and the
    (possibly later dropped) store of its output.  Returns the input buffer
    names in load order.

    A weight computed by a pointwise group of 8-bit data (a dequantisation,
    ``weight_prologue``) is computed here instead: its loads and vector steps
    run in the matmul's k loop, in LX, and the dequantised weight never
    reaches device memory.

    ``out_pieces``: the pieces, per output dim, in which a fused epilogue reads
    the output (``lowering.ReadShape``); each output dim is iterated in the
    finer of its own pieces and those, so the epilogue reads the value where
    the matmul left it."""
    kind = node.python_kernel_name
    b.node_origins = tuple(getattr(node, "origins", None) or ())
    ins = list(node.inputs)
    scaled = kind.endswith("_scaled_mm")
    scales = []
    bias = None
    if scaled:
        a, w, *scales = ins[:4]
        bias = ins[4] if len(ins) > 4 else None
    else:
        bias = ins.pop(0) if has_bias(kind) else None
        a, w = ins
        if float(node.kwargs.get("beta", 1)) == 0:
            bias = None  # baddbmm(beta=0) ignores its input, NaNs included
    asz = _static(a.get_size(), node.get_name())
    wsz = _static(w.get_size(), node.get_name())
    ag, wg = _groups(a, asz), _groups(w, wsz)
    if out_pieces is not None and len(out_pieces) == (3 if kind.endswith("bmm") else 2):
        *rows, cols = out_pieces
        ag = [*(_finer(f, r) for f, r in zip(ag[:-1], rows)), ag[-1]]
        wg = [*wg[:-1], _finer(wg[-1], cols)]
    roles = [_finer(ag[-1], wg[-2])]  # k
    if kind.endswith("bmm"):
        bt, m, k, n = (_dim_expr(b, f) for f in (_finer(ag[0], wg[0]), ag[1], roles[0], wg[2]))
        av, wv, outv = [bt, m, k], [bt, k, n], [bt, m, n]
    else:
        m, k, n = (_dim_expr(b, f) for f in (ag[0], roles[0], wg[1]))
        av, wv, outv = [m, k], [k, n], [m, n]
    kvars = sorted(v.name for v in sympy.sympify(k).free_symbols)
    aval = b.load(*_view_index(b, a, av), share=False)
    prologue = prologues().get(w.get_name())
    if prologue is not None:
        from torch_spyre.compiler.nodes import run_nodes

        # iterate the weight's dims as the matmul reads them (a k read in
        # pieces, heads x head_dim, is computed in those pieces), then store
        # it: an LX value, read below
        wsize = tuple(_static(_buffer_info(w.get_name())[0], node.get_name()))
        wstride = _static(w.get_layout().stride, node.get_name())
        under = _buffer_info(w.get_name())[1]
        factors = {}
        for f, st in zip((roles[0], wg[-1]), wstride[-2:]):
            if st in under:
                factors[(wsize, list(under).index(st))] = f
        run_nodes(b, prologue.nodes, factors)
    wval = b.load(*_view_index(b, w, wv), share=False)
    # k = 1 (an outer product: Mamba-2's dt x B, a rank-1 update) is a
    # broadcast product on the vector unit, not a PE-array contraction
    acc = b.matmul(aval, wval, kvars) if kvars else b.mul(aval, wval)
    alpha = float(node.kwargs.get("alpha", 1))
    beta = float(node.kwargs.get("beta", 1))
    if alpha != 1.0:
        acc = b.mul(acc, Scal(alpha, torch.float32))
    for sc in scales:  # _scaled_mm: scale_a, then scale_b, on the fp32 accumulator
        acc = b.mul(acc, _broadcast_load(b, sc, outv, node.get_name()))
    if bias is not None:
        bval = _broadcast_load(b, bias, outv, node.get_name())
        if beta != 1.0:
            bval = b.mul(bval, Scal(beta, torch.float32))
        acc = b.add(acc, bval)
    out = node.get_layout()
    ostr = _static(out.stride, node.get_name())
    expr = sum((v * st for v, st in zip(outv, ostr)), sympy.Integer(_static([out.offset], "")[0]))
    b.store(node.get_name(), expr, acc)
    return _inputs(b)


# ------------------------------------------------------- weight prologues
class Prologue:
    """A pointwise group computing a matmul's weight from 8-bit data (its
    dequantisation), planned into that matmul (``matmul_steps``)."""

    def __init__(self, nodes, weight: str, reads: list[str]) -> None:
        self.nodes, self.weight, self.reads = nodes, weight, reads


def prologues() -> dict[str, Prologue]:
    """The weight prologues of the graph being compiled, by weight buffer."""
    from torch._inductor.virtualized import V

    return graph_state.of(V.graph.wrapper_code).prologues


def weight_prologue(nodes, scheduler) -> tuple[Prologue, object] | None:
    """(prologue, the consuming matmul's scheduler node) when the fused group
    ``nodes`` only computes the weight operand of one later extern matmul from
    graph inputs including 8-bit data (``W = dequant(wq, scale)`` of a
    quantised linear, then ``mm(x, W.t())``); None otherwise."""
    from torch._inductor import ir
    from torch._inductor.scheduler import BaseSchedulerNode
    from torch._inductor.virtualized import V

    from torch_spyre.layout import FP8_DTYPES

    graph_inputs = set(V.graph.graph_inputs) | set(V.graph.constants)
    reads: list[str] = []
    for n in nodes:
        if not isinstance(n.node, ir.ComputedBuffer) or isinstance(n.node.data, ir.Reduction):
            return None
        for d in n.read_writes.reads:
            if d.name not in reads:
                reads.append(d.name)
    names = {n.get_name() for n in nodes}
    outside = [r for r in reads if r not in names]
    if not outside or any(r not in graph_inputs for r in outside):
        return None
    eight_bit = (*FP8_DTYPES, torch.int8, torch.uint8)
    if not any(V.graph.get_dtype(r) in eight_bit for r in outside):
        return None
    # one buffer leaves the group: the weight, read by exactly one extern matmul
    leaving = []
    for n in nodes:
        for buf in n.get_outputs():
            users = [u for u in buf.users if not (isinstance(u.node, BaseSchedulerNode) and
                                                  u.node.get_name() in names)]  # fmt: skip
            if users:
                leaving.append((buf.get_name(), users))
    if len(leaving) != 1 or len(leaving[0][1]) != 1:
        return None
    weight, (user,) = leaving[0]
    if weight in set(V.graph.get_output_names()):
        return None
    mm = getattr(user.node, "node", None)
    kind = getattr(mm, "python_kernel_name", None)
    if kind not in ("extern_kernels.mm", "extern_kernels.addmm", "extern_kernels._scaled_mm"):
        return None
    ins = list(mm.inputs)
    w = ins[2] if kind.endswith("addmm") else ins[1]
    # the weight is the matmul's right factor, and nothing else of it
    if w.get_name() != weight or sum(x.get_name() == weight for x in ins) != 1:
        return None
    return Prologue(list(nodes), weight, outside), user.node
