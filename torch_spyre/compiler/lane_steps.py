"""Lane steps of a kernel program: reads and writes of sub-stick pieces.

A DMA moves whole sticks and nothing on a core shifts lanes but the PE array
(``compiler/lanes.py``).  ``ProgramBuilder`` inherits these steps:

- ``_lane``: one element of a stick, picked on the vector unit;
- ``_gather``: lanes ``first + sum c_v v`` of a stick dim (sub-stick pieces,
  strided patterns), through a 0/1 table on the PE array;
- ``_scatter``: the converse for a store whose index cuts the stick dim into
  sub-stick pieces (the interleaved rotary of GLM, Cohere, Helium, GPT-J:
  ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)`` writes lane
  ``2 i + j``): the value contracted with the same table over its pieces, or,
  when it may hold an infinity (``0 * inf`` is NaN), a select per lane on the
  vector unit.
"""

from __future__ import annotations

import math

import sympy
import torch

from torch_spyre.compiler import lanes, pieces
from torch_spyre.compiler.infinities import any_may_be_infinite
from torch_spyre.compiler.kernel_plan import OperandUse
from torch_spyre.compiler.values import Scal, Val
from torch_spyre.compiler.views import _decompose
from torch_spyre.ir import Load, constants
from torch_spyre.kernels.search import Unsupported
from torch_spyre.layout import SpyreTensorLayout


class LaneSteps:
    """Sub-stick reads and writes (mixed into ``lowering.ProgramBuilder``)."""

    def _lane(self, name: str, factors, offs, size, dtype, se: int) -> Val:
        """One element of a stick (``x[..., 3]``: Inductor unrolls reductions
        over fewer than 8 elements into such reads).  A DMA moves whole
        sticks and cannot shift lanes, so the stick is loaded and the lane
        picked on the vector unit: a mask from the lane index, then a
        reduction over the stick with exactly one term kept (exact; integers
        within the card's exact range, which the card checks)."""
        c0 = offs[-1] - offs[-1] % se
        key = ("lane", name, tuple(tuple(f) for f in factors), tuple(offs[:-1]), c0)
        lane = self.lane_vars.get(key)
        if lane is None:
            lane = self.lane_vars[key] = str(self.new_vars("l", [min(se, size[-1] - c0)])[0])
        block = self._load_parts(name, factors[:-1] + [[lane]], offs[:-1] + [c0], size, dtype)
        sel = self._binary("eq", self._iota(lane), Scal(offs[-1] - c0, torch.float32))
        picked = self._vec("where", [sel, block, self._materialise(Scal(0.0, block.dtype))])
        if dtype == torch.bool:
            return self._reduce("any", picked, [lane], torch.bool)
        return self._reduce("sum", picked, [lane], block.dtype)

    def _gather(self, name, rest, terms, first, size, stride, offset, dtype, se: int) -> Val:
        """Stick-dim lanes ``first + sum c_v v`` (sub-stick pieces, strided
        patterns; ``compiler/lanes.py``): the whole sticks covering them, then
        a 0/1 table on the PE array.  ``rest`` indexes the other dims.

        Variables whose lane stride is whole sticks and spans everything
        inside (the heads of a fused qkv: 192 h + 16 + i) are blocks of the
        stick dim read through a pieces view, not gathered: the table covers
        one block's lanes only."""
        terms = sorted(terms, key=lambda t: -t[1])
        outer: list[tuple[str, int]] = []
        base = 0
        while len(terms) > 1:
            v, c = terms[0]
            inner_first = first % c
            span = inner_first + sum(ci * (self.ranges[vi] - 1) for vi, ci in terms[1:])
            if c % se or span >= c or size[-1] % c:
                break
            outer.append((v, c))
            base += first - inner_first
            first = inner_first
            terms = terms[1:]
        parts = [(self.ranges[v], c) for v, c in terms]
        last = first + sum(c * (n - 1) for n, c in parts)
        block_lanes = min(c for _, c in outer) if outer else size[-1]
        lo, cover = lanes.covering(block_lanes, last - first + 1, first, se)
        n = math.prod(p for p, _ in parts)
        if cover * n > lanes.MAX_TABLE:
            raise Unsupported(
                f"elements {first}..{last} of the stick dim of {name} {list(size)} in parts "
                f"{parts}: a lane gather of {cover} x {n} is larger than {lanes.MAX_TABLE} "
                f"(not whole sticks of {se})"
            )
        rest = sympy.expand(
            rest + base + sum(sympy.Symbol(v, integer=True, nonnegative=True) * c for v, c in outer)
        )
        j = self.new_vars("j", [cover])[0]
        idx = sympy.expand(rest + offset + lo + j)
        try:
            factors, offs = _decompose(idx, size, stride, offset, self.ranges, f"load of {name}")
            block = self._load_parts(name, factors, offs, size, dtype)
        except Unsupported:
            try:
                dims = pieces.decompose(idx, size, stride, offset, self.ranges, dtype)
            except pieces.PiecesError as e:
                raise Unsupported(f"load of {name}: {e}") from None
            block = self._load_pieces(name, dims, size, dtype)
        # a block this group loaded already carries its own lane variable
        j = next((d for d in block.dims if self.uf.find(d) == self.uf.find(str(j))), str(j))
        use = self._table(cover, first - lo, parts, dtype)
        vs = [v for v, _ in terms]
        buf = self._buf({str(j), *vs}, dtype, double=True)
        self.steps.append(Load(buf, use.name, (str(j), *vs)))
        out = self.matmul(block, Val(buf, frozenset({str(j), *vs}), dtype), [str(j)])
        if not dtype.is_floating_point:
            # the PE array accumulates in fp32: a gathered mask or integer is
            # one product per lane, exact; converted back to what was loaded
            # (a `where` reads a bool condition)
            out = self._vec("copy", [out], (), dtype)
        return out

    def _table(self, lanes_: int, off: int, parts, dtype) -> OperandUse:
        """The 0/1 lane table ``E[j, i_1..i_r]`` (``ir/constants.table``) as an operand."""
        key = constants.table_key(lanes_, off, parts, dtype)
        use = self.operands.get(("eye", key))
        if use is None:
            lay = SpyreTensorLayout.default((lanes_, *(p for p, _ in parts)), dtype)
            shape = (lanes_, off, *(x for pc in parts for x in pc))
            use = OperandUse(f"ey{len(self.operands)}", key, "eye", lay, shape)
            self.operands[("eye", key)] = use
        return use

    def _scatter(self, name: str, factors, value: Val, size, dtype) -> tuple[list, Val]:
        """A store whose stick-dim pieces ``factors[-1]`` are not whole sticks:
        the value with those pieces placed on one lane variable ``l`` of the
        whole stick dim, and the store's factors with ``[l]`` for them.

        ``out[.., l] = sum_p value[.., p] * E[l, p]``, ``E[l, p] = 1`` where
        ``l == sum_k c_k p_k``: exact (one product ``v * 1`` per lane), on the
        PE array; when the value may hold an infinity, a select per lane and a
        sum on the vector unit instead (also exact)."""
        vs = list(factors[-1])
        widths = [self.ranges[v] for v in vs]
        if math.prod(widths) != size[-1]:
            raise Unsupported(f"a store into part of the stick dim of {name}")
        parts, c = [], 1
        for w in reversed(widths):
            parts.insert(0, (w, c))
            c *= w
        lane = str(self.new_vars("l", [size[-1]])[0])
        if self._finite(value):
            use = self._table(size[-1], 0, parts, dtype)
            buf = self._buf({lane, *vs}, dtype, double=True)
            self.steps.append(Load(buf, use.name, (lane, *vs)))
            out = self.matmul(value, Val(buf, frozenset({lane, *vs}), dtype), vs)
        else:
            pos = None
            for v, (_, k) in zip(vs, parts):
                t = (
                    self._iota(v)
                    if k == 1
                    else self._vec("mul_scalar", [self._iota(v)], (float(k),))
                )
                pos = t if pos is None else self._vec("add", [pos, t])
            sel = self._vec("eq", [self._iota(lane), pos], (), torch.bool)
            zero = self._materialise(Scal(0.0, value.dtype))
            out = self._vec("where", [sel, value, zero])
            for v in reversed(vs):
                out = self._reduce("sum", out, [v], out.dtype)
        if not dtype.is_floating_point:
            out = self._vec("copy", [out], (), dtype)
        return [*factors[:-1], [lane]], out

    def _finite(self, value: Val) -> bool:
        """Whether the node being lowered computes only finite values (its FX
        origins: ``compiler/infinities.py``); unknown origins are not."""
        if not value.dtype.is_floating_point:
            return True
        origins = self.node_origins
        return bool(origins) and not any_may_be_infinite(origins)
