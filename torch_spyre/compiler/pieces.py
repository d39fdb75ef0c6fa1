"""Reads of a sub-block of a reshaped dim: ``x.view(2, 10, d)[:, 2:]`` of a [20, d] buffer.

The stick decomposition (``views._decompose``) describes a read as, per
buffer dim, variables that tile it contiguously.  A slice *inside* an inner
piece of a reshaped dim (the last 8 positions of each head of a [heads *
positions, d] projection, as a sliding-window cache keeps them) is not
contiguous: its variables have coefficients ``u_1 > u_2 > ...`` with gaps.
Such a dim is a reshape into pieces of sizes ``u_{i-1} / u_i`` (same device
bytes as long as the stick dim keeps whole sticks) read from per-piece
offsets: a sub-block load (``Load.offsets``) of the whole buffer in that
view, moving only the sticks of the sub-block.
"""

from __future__ import annotations

import sympy

from torch_spyre.layout import stick_elems


class PiecesError(ValueError):
    pass


def decompose(index, sizes, strides, offset, ranges: dict[str, int], dtype):
    """Per buffer dim: (piece sizes outer to inner, the variable of each piece or
    None for a piece read at one element, the offset into each piece).

    Raises ``PiecesError`` when the read is not a sub-block of pieces."""
    idx = sympy.expand(sympy.sympify(index) - offset)
    coeff: dict[str, int] = {}
    rest = idx
    for s in idx.free_symbols:
        c = idx.coeff(s)
        if not c.is_Integer:
            raise PiecesError(f"non-affine index {idx}")
        if int(c) and ranges.get(s.name, 1) > 1:
            coeff[s.name] = int(c)
        rest = rest - c * s
    rest = sympy.expand(rest)
    if not rest.is_Integer:
        raise PiecesError(f"non-affine index {idx}")
    per_dim: list[list[str]] = [[] for _ in sizes]
    for name, c in coeff.items():
        hit = next(
            (
                j
                for j, (sz, st) in enumerate(zip(sizes, strides))
                if sz > 1 and st > 0 and c % st == 0 and st <= c < st * sz
            ),
            None,
        )
        if hit is None:
            raise PiecesError(f"index {idx} does not follow the buffer's strides")
        per_dim[hit].append(name)
    dim_off = [0] * len(sizes)
    rem = int(rest)
    for j in sorted(range(len(sizes)), key=lambda j: -strides[j]):
        if sizes[j] > 1 and strides[j] > 0:
            dim_off[j], rem = divmod(rem, strides[j])
    if rem:
        raise PiecesError(f"index {idx} starts between elements")
    se = stick_elems(dtype)
    out = []
    for j, (sz, st) in enumerate(zip(sizes, strides)):
        vs = sorted(per_dim[j], key=lambda n: -coeff[n])
        units = [coeff[v] // st for v in vs]
        if not vs:
            out.append(([sz], [None], [dim_off[j]]))
            continue
        if units[-1] != 1:  # a strided innermost variable: an unindexed inner piece
            units.append(1)
            vs.append(None)
        if sz % units[0] or any(a % b for a, b in zip(units, units[1:])):
            raise PiecesError(f"dim {j} of size {sz} is not a reshape into pieces of {units}")
        psizes = [sz // units[0]] + [a // b for a, b in zip(units, units[1:])]
        poffs = [dim_off[j] // units[0]] + [
            (dim_off[j] // u) % p for u, p in zip(units[1:], psizes[1:])
        ]
        for v, p, o in zip(vs, psizes, poffs):
            n = ranges[v] if v is not None else 1
            if o + n > p:
                raise PiecesError(f"dim {j}: {n} elements from {o} run past a piece of {p}")
        if j == len(sizes) - 1 and (psizes[-1] % se or poffs[-1] % se) and len(psizes) > 1:
            raise PiecesError("pieces of the stick dim narrower than a stick")
        out.append((psizes, vs, poffs))
    return out
