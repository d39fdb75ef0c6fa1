"""``sin`` and ``cos`` inside a kernel program: the eager adapter's polynomial as vector steps.

The vector units have no sine.  A graph that computes rotary tables itself
(a rope type the ``tabulate_rotary`` patch leaves alone, a model no adapter
knows) gets the eager adapter's evaluation (``ops/adapters.py``): the
argument reduced to [-pi, pi] with a two-constant (Cody-Waite) 2*pi, then a
Taylor polynomial in Horner form (error below 3e-8 on [-pi, pi]).  About 20
simple vector steps per element, fused into the kernel that uses them.
"""

from __future__ import annotations

import math

from torch_spyre.compiler.values import Scal
from torch_spyre.ops.adapters import _COS, _SIN, _TWO_PI_HI, _TWO_PI_LO


def trig(builder, x, cos: bool):
    """The steps computing ``cos(x)`` or ``sin(x)`` (``builder``: a lowering.ProgramBuilder)."""
    if isinstance(x, Scal):
        return Scal((math.cos if cos else math.sin)(float(x.value)), x.dtype)
    x = builder._materialise(x)
    vec = builder._vec
    k = vec("round", [vec("mul_scalar", [x], (1.0 / (2 * math.pi),))])
    y = vec("sub", [x, vec("mul_scalar", [k], (_TWO_PI_HI,))])
    y = vec("sub", [y, vec("mul_scalar", [k], (_TWO_PI_LO,))])
    y2 = vec("square", [y])
    coeffs = _COS if cos else _SIN
    acc = vec("mul_scalar", [y2], (coeffs[-1],))
    for c in reversed(coeffs[1:-1]):
        acc = vec("mul", [vec("add_scalar", [acc], (c,)), y2])
    acc = vec("add_scalar", [acc], (coeffs[0],))
    return acc if cos else vec("mul", [y, acc])
