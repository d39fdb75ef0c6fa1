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

from torch_spyre.compiler import lowering
from torch_spyre.compiler.nodes import _buffer_info, _static

MATMULS = ("extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm")


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
    nothing is re-laid); a plain view covers one dim each."""
    plain = [[s] for s in vsz]
    usz, ustr, uoff, _ = _buffer_info(inp.get_name())
    lay = inp.get_layout()
    if (
        _static(lay.stride, inp.get_name()) != _contiguous(vsz)
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


def matmul_steps(b: lowering.ProgramBuilder, node) -> list[str]:
    """Steps of an mm/addmm/bmm extern node: loads, PE-array matmul, bias epilogue,
    and the (possibly later dropped) store of its output.  Returns the input
    buffer names in load order."""
    kind = node.python_kernel_name
    ins = list(node.inputs)
    bias = ins.pop(0) if kind.endswith("addmm") else None
    a, w = ins
    asz = _static(a.get_size(), node.get_name())
    wsz = _static(w.get_size(), node.get_name())
    ag, wg = _groups(a, asz), _groups(w, wsz)
    roles = [_finer(ag[-1], wg[-2])]  # k
    if kind.endswith("bmm"):
        bt, m, k, n = (_dim_expr(b, f) for f in (_finer(ag[0], wg[0]), ag[1], roles[0], wg[2]))
        av, wv, outv = [bt, m, k], [bt, k, n], [bt, m, n]
    else:
        m, k, n = (_dim_expr(b, f) for f in (ag[0], roles[0], wg[1]))
        av, wv, outv = [m, k], [k, n], [m, n]
    kvars = sorted(v.name for v in sympy.sympify(k).free_symbols)
    if not kvars:
        raise lowering.Unsupported("a matmul with k = 1")
    names = []
    aval = b.load(*_view_index(b, a, av), share=False)
    names.append(a.get_name())
    wval = b.load(*_view_index(b, w, wv), share=False)
    names.append(w.get_name())
    acc = b.matmul(aval, wval, kvars)
    alpha = float(node.kwargs.get("alpha", 1))
    beta = float(node.kwargs.get("beta", 1))
    if alpha != 1.0:
        acc = b.mul(acc, lowering.Scal(alpha, torch.float32))
    if bias is not None:
        bsz = _static(bias.get_size(), node.get_name())
        bvars = outv[len(outv) - len(bsz) :]
        bvars = [v if s > 1 else sympy.Integer(0) for v, s in zip(bvars, bsz)]
        bval = b.load(*_view_index(b, bias, bvars))
        names.append(bias.get_name())
        if beta != 1.0:
            bval = b.mul(bval, lowering.Scal(beta, torch.float32))
        acc = b.add(acc, bval)
    out = node.get_layout()
    ostr = _static(out.stride, node.get_name())
    expr = sum((v * st for v, st in zip(outv, ostr)), sympy.Integer(_static([out.offset], "")[0]))
    b.store(node.get_name(), expr, acc)
    return names
