"""Sub-stick pieces of the stick dim: lane gathers on the PE array.

A stick is 128 bytes (64 fp16 / 32 fp32 lanes) and the DMA engines move
whole sticks; nothing on a core shifts lanes but the PE array.  A read that
cuts the stick dim into pieces narrower than a stick — a reshape into heads
of 16 or 32 (``q.view(b, s, heads, 16)``), a slice that does not start on a
stick (partial rotary ``x[..., :4]``, Mamba's ``split`` of ``in_proj`` at
element 56) — is therefore planned as

    load the whole sticks covering the range  ->  x[..., j]       (DMA)
    x @ E,  E[j, p, w] = 1 where j = off + flat(p, w)               (PE array)

with ``E`` a constant 0/1 table (``ir/constants.py``: made once per kernel
and card, like the iota tables).  Exact: every output is one product ``x * 1`` accumulated in
fp32 with zeros (an infinite or NaN input would spread through ``0 * inf``,
as in the RoPE lane shuffle).  The cost is a matmul of the covered lanes by
the piece's elements per row, on the PE array (the modelled time says so);
ranges larger than ``MAX_TABLE`` elements are refused.
"""

from __future__ import annotations

import math

#: largest gather table (covered lanes x piece elements): 256 KiB in fp32
MAX_TABLE = 1 << 16


def needs_gather(size: int, sizes: list[int], off: int, se: int) -> bool:
    """True when reading ``prod(sizes)`` elements of a stick dim of ``size``
    from ``off``, in pieces ``sizes`` (outer to inner), is not whole sticks."""
    n = math.prod(sizes)
    if len(sizes) > 1 and sizes[-1] % se:
        return True
    if off % se:
        return True
    return bool((off + n) % se and off + n != size)


def covering(size: int, n: int, off: int, se: int) -> tuple[int, int]:
    """(first element, length) of the whole sticks covering [off, off + n),
    within the dim (its last stick may be partial)."""
    first = off - off % se
    end = min(-(-(off + n) // se) * se, size)
    return first, end - first


def stick_terms(index, sizes, strides, offset, ranges: dict[str, int]):
    """The terms of an affine ``index`` that address the stick (last) dim of a
    contiguous buffer: ``(rest, [(var, coefficient)], first element)`` with
    ``rest`` the index of the other dims, or None.  For reads the stick
    decomposition cannot express: a strided pattern inside the stick dim
    (GPT-NeoX's fused qkv: head h's query at ``48 h + d``, d < 16)."""
    import sympy

    if len(sizes) < 1 or strides[-1] != 1 or (len(sizes) > 1 and strides[-2] != sizes[-1]):
        return None
    n = sizes[-1]
    idx = sympy.expand(sympy.sympify(index) - offset)
    terms, rest = [], idx
    for sym in sorted(idx.free_symbols, key=lambda x: x.name):
        c = idx.coeff(sym)
        if not c.is_Integer:
            return None
        c = int(c)
        if 0 < c < n:
            terms.append((sym.name, c))
            rest = rest - c * sym
    rest = sympy.expand(rest)
    const = rest.as_coeff_Add()[0] if not rest.is_Integer else rest
    first = int(const) % n
    if first + sum(c * (ranges.get(v, 1) - 1) for v, c in terms) >= n:
        return None
    return sympy.expand(rest - first), terms, first
