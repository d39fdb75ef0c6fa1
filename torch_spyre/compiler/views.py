"""How a load or store index reads an Inductor buffer, as a view of its device bytes.

``_decompose`` splits an affine index into, per buffer dim, the iteration
variables that index it (outer to inner, with ghost pieces for the blocks a
read skips) and the element offset it starts at; ``view_layout`` turns such
a split into the layout of the same device bytes read as a view (a reshape
or a slice that is one contiguous block of sticks: no data moved), and
``strided_view`` into a whole-buffer operand read from per-dim offsets when
it is not one block.  ``_stored_layout`` is the non-default layout a
producer chose for an intermediate (``compiler.layouts``).  Anything else
raises ``Unsupported``.
"""

from __future__ import annotations

import math

import sympy

from torch_spyre.kernels.search import Unsupported
from torch_spyre.layout import SpyreTensorLayout, stick_elems


# ------------------------------------------------------- index decomposition
def _decompose(index, sizes, strides, offset, ranges: dict[str, int], what: str):
    """How an affine index reads a buffer: per buffer dim, the variables that
    index it (outer to inner) and the element offset the read starts at.

    Raises ``Unsupported`` for anything else (non-affine, dims mixed, reads
    outside the buffer)."""
    index = sympy.expand(sympy.sympify(index) - offset)
    coeff: dict[str, int] = {}
    rest = index
    for s in index.free_symbols:
        c = index.coeff(s)
        if not c.is_Integer:
            raise Unsupported(f"{what}: non-affine index {index}")
        coeff[s.name] = int(c)
        rest = rest - c * s
    rest = sympy.expand(rest)
    if not rest.is_Integer:
        raise Unsupported(f"{what}: non-affine index {index}")
    per_dim: list[list[str]] = [[] for _ in sizes]
    for name, c in coeff.items():
        if c == 0 or ranges.get(name, 1) == 1:
            continue
        hit = None
        for j, (sz, st) in enumerate(zip(sizes, strides)):
            if sz > 1 and st > 0 and c % st == 0 and st <= c < st * sz:
                hit = j
                break
        if hit is None:
            raise Unsupported(f"{what}: index {index} does not follow the buffer's strides")
        per_dim[hit].append(name)
    offsets = [0] * len(sizes)
    rem = int(rest)
    for j in sorted(range(len(sizes)), key=lambda j: -strides[j]):
        if sizes[j] > 1 and strides[j] > 0:
            offsets[j], rem = divmod(rem, strides[j])
    if rem:
        raise Unsupported(f"{what}: index {index} starts between elements")
    out: list[list[str]] = []
    for j, (sz, st) in enumerate(zip(sizes, strides)):
        vs = sorted(per_dim[j], key=lambda n: -coeff[n])
        expect = st
        pieces: list[str] = []
        for n in reversed(vs):
            if coeff[n] != expect:
                # a gap between two variables (x[t, h, 0, :] of a [t, h*2*64] buffer:
                # every other block of sticks): a ghost piece read at one position
                if not pieces or coeff[n] % expect:
                    raise Unsupported(f"{what}: index {index} mixes dims of the buffer")
                pieces.append(ghost(coeff[n] // expect))
                expect = coeff[n]
            pieces.append(n)
            expect *= ranges[n]
        vs = pieces[::-1]
        last = offsets[j] + sum((ranges[n] - 1) * coeff[n] // st for n in vs if not is_ghost(n))
        if last >= max(sz, 1):
            raise Unsupported(f"{what}: index {index} reads past dim {j} of the buffer")
        out.append(vs)
    return out, offsets


def dim_pieces(coeff: int, rng: int, bsize, bstride) -> list[int] | None:
    """How an index variable with ``coeff`` and range ``rng`` must be split to
    read a buffer of ``bsize``/``bstride`` one dim per piece: factor sizes,
    outer to inner, when it runs past the end of the buffer dim it starts in
    into the next outer dims of a contiguous stretch (a flat read of a
    ``[16, 128]`` buffer: ``[16, 128]``); None when it needs no split or no
    split serves."""
    dims = [j for j, (sz, st) in enumerate(zip(bsize, bstride)) if sz > 1 and st > 0]
    hit = next(
        (
            j
            for j in dims
            if coeff % bstride[j] == 0 and bstride[j] <= coeff < bstride[j] * bsize[j]
        ),
        None,
    )
    if hit is None or rng <= 1:
        return None
    step = coeff // bstride[hit]
    if bsize[hit] % step:
        return None
    inner, j, pieces = bsize[hit] // step, hit, []
    while rng > inner:
        outer = [k for k in dims if bstride[k] == bstride[j] * bsize[j]]
        if rng % inner or not outer:
            return None
        pieces.append(inner)
        rng //= inner
        j = outer[0]
        inner = bsize[j]
    return [rng, *pieces[::-1]] if pieces else None


def ghost(n: int) -> str:
    """A piece of a buffer dim that a load skips over (read at one position)."""
    return f"~{n}"


def is_ghost(v: str) -> bool:
    return v.startswith("~")


def view_layout(size, dtype, factors, offsets=None):
    """The default layout of a buffer of ``size`` read as a view: dim j split
    into ``factors[j]`` (sizes, outer to inner; [] for an unindexed dim),
    starting ``offsets[j]`` elements in.  Same device bytes, no data moved:
    returns (layout of the view, first device element), or raises
    ``Unsupported`` when the view is not one contiguous block of sticks."""
    size = tuple(size) or (1,)
    offsets = list(offsets or [0] * len(size))
    base = SpyreTensorLayout.default(size, dtype)
    n = len(size)
    se = stick_elems(dtype)
    # per host dim: full sizes of its pieces, and (offset, length) of the outer one
    full: list[list[int]] = []
    part: list[tuple[int, int]] = []
    for j, f in enumerate(factors):
        f = list(f) or [1]
        inner = math.prod(f[1:])
        if size[j] % inner or offsets[j] % inner:
            raise Unsupported(f"a reshape of a {list(size)} buffer that does not divide dim {j}")
        full.append([size[j] // inner] + f[1:])
        part.append((offsets[j] // inner, f[0]))
    first, pos = [], 0
    for f in full:
        first.append(pos)
        pos += len(f)
    dev: list[list] = []  # [size, host position, (offset, length) or None]
    last_dev = len(base.device_size) - 1
    for i_dev, (ds, k) in enumerate(zip(base.device_size, base.dim_map)):
        if k < 0:
            dev.append([ds, k, None])
            continue
        f, (o, c) = full[k], part[k]
        partial = (o, c) if (o or c < f[0]) else None
        if i_dev == last_dev:  # the lanes of a stick: the innermost piece of the stick dim
            dev.append([se, first[k] + len(f) - 1, None])
        elif k != n - 1:
            for i, x in enumerate(f):
                dev.append([x, first[k] + i, partial if i == 0 else None])
        elif len(f) > 1:  # the stick blocks of a split stick dim
            if f[-1] % se:
                raise Unsupported(
                    f"a reshape that splits the stick dim of a {list(size)} buffer "
                    f"into pieces of {f[-1]} (not whole sticks of {se})"
                )
            for i, x in enumerate(f[:-1]):
                dev.append([x, first[k] + i, partial if i == 0 else None])
            dev.append([f[-1] // se, first[k] + len(f) - 1, None])
        else:
            if partial and (o % se or (c % se and o + c != size[k])):
                raise Unsupported(
                    f"a slice [{o}:{o + c}] of the stick dim of a {list(size)} buffer "
                    "that is not whole sticks"
                )
            blk = (o // se, -(-c // se)) if partial else None
            dev.append([-(-size[k] // se), first[k], blk])
    # the view must be one contiguous block: one device dim is cut, and every
    # device dim outside it has size 1
    cut = [i for i, d in enumerate(dev) if d[2] is not None]
    if len(cut) > 1 or (cut and any(d[0] != 1 for d in dev[: cut[0]])):
        raise Unsupported(
            f"a slice of a {list(size)} buffer that is not contiguous in device memory"
        )
    start = 0
    if cut:
        p = cut[0]
        o, c = dev[p][2]
        start = o * math.prod(d[0] for d in dev[p + 1 :])
        dev[p] = [c, dev[p][1], None]
    host = []
    for j, f in enumerate(full):
        host.extend([part[j][1]] + f[1:])
    lay = SpyreTensorLayout(tuple(host), tuple(d[0] for d in dev), tuple(d[1] for d in dev), dtype)
    return lay, start


def _stored_layout(buffer: str) -> SpyreTensorLayout | None:
    """The non-default layout a computed intermediate is stored in, if its
    producer chose one (``compiler.layouts``)."""
    from torch_spyre.compiler import layouts

    return layouts.layout_of(buffer)


def strided_view(size, dtype, factors, offsets, ghosts=None):
    """A view that is *not* one contiguous block (a slice of an inner dim:
    the first n positions of every head of a KV cache): the whole buffer as
    the operand, read by a load from per-dim offsets (``Load.offsets``).

    Returns (layout of the whole buffer viewed in ``factors``' pieces, the
    offset along each view host dim).  Raises ``Unsupported`` when the
    offset into the stick dim is not whole sticks (no DMA shifts lanes)."""
    size = tuple(size) or (1,)
    offsets = list(offsets or [0] * len(size))
    se = stick_elems(dtype)
    whole, offs = [], []
    for j, f in enumerate(factors):
        f = list(f) or [1]
        inner = math.prod(f[1:])
        if size[j] % inner:
            raise Unsupported(f"a reshape of a {list(size)} buffer that does not divide dim {j}")
        pieces = [size[j] // inner] + f[1:]
        # the dim's element offset in the pieces' mixed radix; only the outer
        # piece and ghost pieces (ghosts=1-based positions in `ghosts[j]`) start
        # anywhere but 0
        rem, piece_offs = offsets[j], []
        for p in reversed(pieces[1:]):
            rem, o = divmod(rem, p)
            piece_offs.append(o)
        piece_offs = [rem] + piece_offs[::-1]
        free = set(ghosts[j]) if ghosts else set()
        if any(o and i and i not in free for i, o in enumerate(piece_offs)):
            raise Unsupported(
                f"a read of a {list(size)} buffer from element {offsets[j]} of dim {j}"
            )
        if j == len(size) - 1 and piece_offs[-1] % se:
            raise Unsupported(
                f"a slice from element {offsets[j]} of the stick dim of a {list(size)} "
                f"buffer (not whole sticks of {se}: a DMA cannot shift lanes)"
            )
        whole.append(pieces)
        offs.extend(piece_offs)
    lay, start = view_layout(size, dtype, whole)
    assert start == 0
    return lay, tuple(offs)
