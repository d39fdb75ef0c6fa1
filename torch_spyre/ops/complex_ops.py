"""complex64 on the card: element-wise ops as fp32 ops on (real, imaginary) pairs.

Device memory stores a complex64 tensor as interleaved fp32 pairs (16 complex
values per 128-byte stick, ``layout.SUPPORTED_DTYPES``): ``view_as_real`` and
``view_as_complex`` are views of the same bytes, no data moved.  The vector
unit has no complex arithmetic, so each element-wise op on complex tensors is
rewritten here into fp32 ops on the real and imaginary parts (each a device
kernel, timed as such: a complex multiply is four multiplies and two adds),
and the parts are interleaved back.  The forms rotary embeddings use
(Llama 4, Meta's reference Llama: ``view_as_complex(x) * freqs_cis`` with
``freqs_cis = polar(ones, angles)``) are covered; any other op on a complex
tensor raises a clear error rather than computing on the pairs as if they
were reals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_spyre.ops.adapters import _bind, adapter

C64 = torch.complex64


class ComplexOpError(NotImplementedError):
    """An op on complex64 spyre tensors that has no rewrite into real ops."""


def is_complex(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


def _parts(v: Any) -> tuple[Any, Any]:
    """(real, imaginary) of a complex tensor (views), a real tensor or a number."""
    if is_complex(v):
        if v.is_conj():
            v = v.conj()  # the unconjugated view: its imaginary part negated below
            pair = torch.view_as_real(v)
            return pair[..., 0], -pair[..., 1]
        pair = torch.view_as_real(v)
        return pair[..., 0], pair[..., 1]
    if isinstance(v, complex):
        return v.real, v.imag
    return v, 0.0


def _join(re: torch.Tensor, im: Any) -> torch.Tensor:
    """The complex64 tensor of parts ``re`` and ``im`` (pairs interleaved)."""
    re = re.float()
    im = torch.zeros_like(re) if not isinstance(im, torch.Tensor) else im.float()
    re, im = torch.broadcast_tensors(re, im)
    return torch.view_as_complex(torch.stack((re, im), -1).contiguous())


def _mul(a, b):
    ar, ai = _parts(a)
    br, bi = _parts(b)
    return _join(ar * br - ai * bi, ar * bi + ai * br)


def _add(a, b, alpha=1):
    ar, ai = _parts(a)
    br, bi = _parts(b)
    if alpha != 1:
        br, bi = br * alpha, bi * alpha
    return _join(ar + br, ai + bi)


def _sub(a, b, alpha=1):
    return _add(a, b, -alpha)


def _div(a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise ComplexOpError("spyre: complex division has no rounding mode (as on the CPU)")
    ar, ai = _parts(a)
    br, bi = _parts(b)
    den = br * br + bi * bi
    return _join((ar * br + ai * bi) / den, (ai * br - ar * bi) / den)


def _neg(a):
    ar, ai = _parts(a)
    return _join(-ar, -ai)


def _abs(a):
    re, im = _parts(a)
    return torch.sqrt(re * re + im * im)


def _resolve(a):
    ar, ai = _parts(a)
    return _join(ar + 0.0, ai + 0.0)


#: aten base name -> the rewrite (arguments as aten binds them)
REWRITES: dict[str, Callable[..., torch.Tensor]] = {
    "mul": lambda b: _mul(b["self"], b["other"]),
    "add": lambda b: _add(b["self"], b["other"], b.get("alpha", 1)),
    "sub": lambda b: _sub(b["self"], b["other"], b.get("alpha", 1)),
    "div": lambda b: _div(b["self"], b["other"], b.get("rounding_mode")),
    "neg": lambda b: _neg(b["self"]),
    "resolve_conj": lambda b: _resolve(b["self"]),
    "conj_physical": lambda b: _resolve(b["self"].conj()),
    "clone": lambda b: _resolve(b["self"]),
    "abs": lambda b: _abs(b["self"]),
}


def run(op, args: tuple, kwargs: dict) -> Any:
    """``op`` on complex spyre tensors, as real ops on their parts."""
    base = op._schema.name.split("::")[-1].rstrip("_")
    rewrite = REWRITES.get(base)
    if rewrite is None:
        raise ComplexOpError(
            f"spyre: aten.{base} on complex64 tensors has no device form (complex tensors "
            "support view_as_real / view_as_complex, polar, complex, abs, +, -, *, / and "
            "conj). Compute it on the real and imaginary parts (torch.view_as_real), or on "
            "the CPU."
        )
    bound = _bind(op, args, kwargs)
    written = [
        a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    dests = [bound.pop(n) if n != "self" else bound["self"] for n in written]
    result = rewrite(bound)
    if not dests:
        return result
    dest = dests[0]
    if dest.shape != result.shape:
        dest.resize_(result.shape)
    if dest.is_complex():
        torch.view_as_real(dest).copy_(torch.view_as_real(result))
    elif result.is_complex():
        dest.copy_(torch.view_as_real(result)[..., 0])
    else:
        dest.copy_(result)
    return dest


@adapter("polar", reason="complex64 from magnitude and angle: abs * cos, abs * sin, interleaved")
def _polar(op, bound):
    r, theta = bound["abs"], bound["angle"]
    return _join(r * torch.cos(theta), r * torch.sin(theta))


@adapter("complex", reason="complex64 from real and imaginary parts, interleaved")
def _complex(op, bound):
    return _join(bound["real"], bound["imag"])
