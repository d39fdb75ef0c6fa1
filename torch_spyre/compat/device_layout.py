"""``device_layout=`` on ``Tensor.to`` and the factories (the two PyTorch patches)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torch_spyre.compat.layouts import _spyre_target, empty_in_layout, fit, same_device_layout
from torch_spyre.layout import (
    SpyreTensorLayout,
    UnsupportedDtypeError,
)

_orig_to = torch.Tensor.to
_orig_factories: dict[str, Any] = {}


def _dtype_named(arg: Any) -> Any:
    """IBM's ``Tensor.to`` takes a dtype by name ("torch.float32", as their
    model-op YAML records it); anything else is passed on."""
    if isinstance(arg, str) and arg.startswith("torch."):
        dtype = getattr(torch, arg.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return arg


@contextlib.contextmanager
def _dtype_error_as_ibm() -> Iterator[None]:
    """The C++ dtype check raises a TypeError, IBM's runtime a RuntimeError:
    ours (``layout.UnsupportedDtypeError``) is both."""
    try:
        yield
    except TypeError as err:
        if type(err) is TypeError and str(err).startswith("spyre does not store"):
            raise UnsupportedDtypeError(str(err)) from None
        raise


def _to(self: torch.Tensor, *args, device_layout: SpyreTensorLayout | None = None, **kwargs):
    args = tuple(_dtype_named(a) for a in args)
    if "dtype" in kwargs:
        kwargs["dtype"] = _dtype_named(kwargs["dtype"])
    if device_layout is None:
        with _dtype_error_as_ibm():
            return _orig_to(self, *args, **kwargs)
    if not isinstance(device_layout, SpyreTensorLayout):
        raise TypeError(
            f"device_layout must be a torch.spyre.SpyreTensorLayout, got "
            f"{type(device_layout).__name__}"
        )
    copy = bool(kwargs.pop("copy", False))
    device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
    device = _spyre_target(device or self.device)
    dtype = dtype or self.dtype
    if (
        not copy
        and self.device.type == "spyre"
        and (device.index is None or device == self.device)
        and dtype == self.dtype
        and self.is_contiguous()
        and same_device_layout(self.device_tensor_layout(), fit(device_layout, self.shape, dtype))
    ):
        return self
    strides = None if self.is_contiguous() else self.stride()
    out = empty_in_layout(self.shape, device_layout, dtype, device, strides)
    out.copy_(self)
    return out


def _sizes(args, size) -> list[int]:
    if size is not None:
        if args:
            raise TypeError("empty() got both a positional size and size=")
        args = (size,)
    if len(args) == 1 and isinstance(args[0], Sequence | torch.Size):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


def _factory(name: str, fill_arg: bool):
    orig = getattr(torch, name)
    _orig_factories[name] = orig

    @functools.wraps(orig)
    def factory(*args, device_layout: SpyreTensorLayout | None = None, **kwargs):
        if args and "size" in kwargs:  # IBM's (PyTorch's parser's) wording
            raise TypeError(
                f"{name}() received an invalid combination of arguments: a positional "
                f"size and size= (give one)"
            )
        if device_layout is None:
            with _dtype_error_as_ibm():
                return orig(*args, **kwargs)
        args = list(args)
        fill = (
            (kwargs.pop("fill_value") if "fill_value" in kwargs else args.pop()) if fill_arg else 0
        )
        requires_grad = kwargs.pop("requires_grad", False)
        dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
        fmt = kwargs.get("memory_format")
        if fmt is not None and fmt not in (torch.contiguous_format, torch.preserve_format):
            # a device layout fixes where every element goes: the host strides
            # are the contiguous ones (without device_layout= we take any format)
            raise RuntimeError(
                f"Spyre backend only supports contiguous memory format with device_layout= "
                f"(got {fmt}); drop device_layout= for a {fmt} tensor in the default layout"
            )
        for ignored in ("layout", "pin_memory", "memory_format", "out"):
            value = kwargs.pop(ignored, None)
            if ignored == "out" and value is not None:
                raise TypeError(f"torch.{name}(..., device_layout=...) does not take out=")
        size = _sizes(args, kwargs.pop("size", None))
        if kwargs:
            raise TypeError(f"torch.{name}() got unexpected keywords {sorted(kwargs)}")
        out = empty_in_layout(size, device_layout, dtype, device)
        if name != "empty":
            out.fill_(fill)
        return out.requires_grad_(requires_grad) if requires_grad else out

    return factory


_FACTORIES = {"empty": False, "zeros": False, "full": True}


def _ones(*args, device_layout=None, **kwargs):
    if device_layout is None:
        return _orig_factories["ones"](*args, **kwargs)
    return _patched["zeros"](*args, device_layout=device_layout, **kwargs).fill_(1)


_patched: dict[str, Any] = {}


def _install_device_layout() -> None:
    if getattr(torch.Tensor.to, "__wrapped_by_spyre__", False):
        return
    # `with torch.device(...)` recognises factories by identity in a cached set:
    # fill the cache with the original functions before replacing them.
    from torch.utils._device import _device_constructors

    _device_constructors()
    _to.__wrapped_by_spyre__ = True  # type: ignore[attr-defined]
    functools.update_wrapper(_to, _orig_to, assigned=("__doc__", "__name__", "__qualname__"))
    _to.__signature__ = _signature(method=True)  # type: ignore[attr-defined]
    torch.Tensor.to = _to  # type: ignore[method-assign]
    for name, fill in _FACTORIES.items():
        _patched[name] = _factory(name, fill)
        _patched[name].__signature__ = _signature(method=False)
        setattr(torch, name, _patched[name])
    _orig_factories["ones"] = torch.ones
    functools.update_wrapper(_ones, torch.ones)
    _ones.__signature__ = _signature(method=False)  # type: ignore[attr-defined]
    torch.ones = _ones  # type: ignore[assignment]
    _keep_dynamo_rules()


def _keep_dynamo_rules() -> None:
    """Keep the original factories in Dynamo's in-graph function rules.

    Dynamo finds its rule for a torch function by object, in a map it builds
    from names (``"torch.zeros"``) and caches (``trace_rules.
    get_torch_obj_rule_map``).  Built before the patch above, the map holds
    the builtins and Dynamo inlines our wrappers down to them.  But
    ``torch.distributed.init_process_group`` clears that cache (as vLLM's
    engine does on start), and the rebuilt map resolves the names to our
    wrappers: the builtins lose their rule, and every compiled call of
    ``torch.zeros`` / ``empty`` / ``full`` / ``ones`` (an RNN's initial state)
    became a graph break and ran eagerly, in every later ``torch.compile`` of
    the process.  No public hook gives a C builtin its rule
    (``allow_in_graph`` takes Python callables), so the builtins are added to
    the rule names by a path that still reaches them after the patch
    (``torch._C._VariableFunctions#zeros``).  Tested by
    ``tests/runtime/test_compat.py::test_factories_compile_after_dynamos_rules_are_rebuilt``,
    which fails if torch renames these tables."""
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import TorchInGraphFunctionVariable

    trace_rules.manual_torch_name_rule_map.update(
        (f"torch._C._VariableFunctions#{name}", TorchInGraphFunctionVariable)
        for name in _orig_factories
    )
    trace_rules.get_torch_obj_rule_map.cache_clear()


def _signature(method: bool) -> inspect.Signature:
    """What inspect reports for the patched functions (the wrapped builtins
    have none): the device_layout= keyword, the rest as PyTorch parses it."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_ONLY)] if method else []
    params += [
        P("args", P.VAR_POSITIONAL),
        P("device_layout", P.KEYWORD_ONLY, default=None),
        P("kwargs", P.VAR_KEYWORD),
    ]
    return inspect.Signature(params)
