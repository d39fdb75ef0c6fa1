"""Registration of explicit spyre kernels for aten overloads (torch.library)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_spyre.ops.errors import annotated, fp8_arithmetic, fp8_operand
from torch_spyre.runtime import dispatch_stats
from torch_spyre.runtime.registration import entry

_lib: torch.library.Library | None = None
#: (overload name, kernel, dispatch key) declared by the ``kernel`` decorator,
#: registered by ``register()`` (``torch_spyre/__init__.py``): importing an op
#: module registers nothing
_declared: list[tuple[str, Callable, str]] = []


def register() -> None:
    """Register every declared kernel with PyTorch (idempotent)."""
    global _lib
    if _lib is None:
        _lib = torch.library.Library("aten", "IMPL")
    while _declared:
        name, impl, key = _declared.pop(0)
        _lib.impl(name, entry(impl), key)


class NoKernel(Exception):
    """Raised by a kernel for inputs it does not serve (the host fallback runs)."""


def kernel(
    *names: str,
    path: str = "kernel",
    fallback: Callable | None = None,
    fp8: bool = False,
    key: str = "PrivateUse1",
):
    """Register ``fn`` as the PrivateUse1 kernel of the given aten overloads
    (``key``: another dispatch key of the device, ``NestedTensorPrivateUse1``).

    ``fn(*args, **kwargs)`` may return NotImplemented (or raise NoKernel) for
    inputs it does not serve; those then go through the host fallback,
    counted as such.  ``fallback``: the op the host runs instead (an
    ``*_overrideable`` op has no CPU kernel: its generic form runs).  Unless
    ``fp8``, a call with an 8-bit float tensor is refused with an error that
    says what to do (the card has no arithmetic on fp8 outside its quantised
    kernels).
    """

    def wrap(fn: Callable) -> Callable:
        for name in names:
            op = fallback or _overload(name)

            def impl(*args, _fn=fn, _name=name, _op=op, **kwargs):
                if not fp8:
                    dt = fp8_operand(args, kwargs)
                    if dt is not None:
                        raise fp8_arithmetic(_name, dt)
                try:
                    try:
                        result = _fn(*args, **kwargs)
                    except NoKernel:
                        result = NotImplemented
                    if result is NotImplemented:
                        from torch_spyre.runtime.fallback import host_fallback

                        return host_fallback(_op, *args, **kwargs)
                except NoKernel:
                    raise
                except Exception as err:
                    raise annotated(err, _name, args, kwargs) from err.__cause__
                dispatch_stats.record(path, _name)
                return result

            _declared.append((name.removesuffix(".default"), impl, key))
            if _lib is not None:  # declared after registration: register now
                register()
        return fn

    return wrap


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def out_variant(fn: Callable) -> Callable:
    """The ``out=`` form of functional kernel ``fn``: compute, then store into out."""

    def with_out(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        if result is NotImplemented:
            return result
        if out.shape != result.shape:
            out.resize_(result.shape)
        out.copy_(result)
        return out

    return with_out
