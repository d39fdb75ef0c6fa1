"""``torch.compile`` for spyre: an Inductor backend that plans kernel programs.

``register()`` (called by ``import torch_spyre``) installs, through Inductor's
public device hooks only:

* ``register_backend_for_device("spyre", SpyreScheduling, SpyreWrapperCodegen,
  SpyreAotWrapperCodegen, device_custom_pass=...)``: plain
  ``torch.compile(fn)`` on spyre tensors uses it, and AOTInductor
  (``aoti_compile_and_package``) through the third (``compiler/aoti.py``);
  other devices keep their own backends;
* ``register_interface_for_device("spyre", SpyreInterface)``: Dynamo's device
  interface, with properties from the card's hardware config;
* ``register_device_op_overrides("spyre", ...)``: what the wrapper writes for
  device guards and synchronisation.

The custom pass carries the backend's version in its ``uuid()``, which
Inductor puts into the FX graph cache key: code planned by an older
torch_spyre is never replayed.  See docs/compiler.md.
"""

from __future__ import annotations

import importlib.abc
import sys

_registered = False


def backend_version() -> str:
    """torch_spyre's version plus a hash of the sources that shape compiled code
    (one definition: ``runtime.artifact_cache.code_version``, which keys the
    persistent cache too)."""
    from torch_spyre.runtime.artifact_cache import code_version

    return code_version()


def register_interface() -> None:
    """Dynamo's device interface for spyre (needs only torch._dynamo)."""
    from torch._dynamo.device_interface import register_interface_for_device

    from torch_spyre.compiler.interface import SpyreInterface

    register_interface_for_device("spyre", SpyreInterface)
    compile_window()


def compile_window() -> None:
    """Card work done while compiling is not billed to the user's first call
    (sim/card.py ``compile_started``): Dynamo's compile start and end
    callbacks open and close the window.

    ``torch._dynamo.callback`` is the hook Dynamo runs around every
    compilation; no public API exposes it.  ``torch._dynamo.reset()`` clears
    its callbacks (``callback_handler.clear()``), and no hook of ours is sure
    to run after a reset: on an AOTAutograd or FX cache hit no spyre pass runs,
    and a user's own backend runs none at all.  So the handler's ``clear`` is
    wrapped to register the window again, as a fresh process's import would.
    tests/compiler/test_compile_window.py fails if the window stops opening or
    does not survive a reset."""
    from torch._dynamo.callback import callback_handler

    from torch_spyre.sim import card

    if card.compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(card.compile_started)
    if card.compile_ended not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(card.compile_ended)
    clear = callback_handler.clear
    if not getattr(clear, "_keeps_spyre_window", False):

        def clear_keeping_window() -> None:
            clear()
            compile_window()

        clear_keeping_window._keeps_spyre_window = True  # type: ignore[attr-defined]
        callback_handler.clear = clear_keeping_window  # type: ignore[method-assign]


#: Tensor factories that AOTAutograd's cache may take in a graph.  Its
#: cacheability check refuses any C-bound torch function it does not list
#: ("Bypassing autograd cache due to: Unsupported call_function target ...
#: empty"), and vLLM's attention layers allocate their output with
#: ``torch.empty``, our generate's masks with ``torch.zeros``: such a graph was
#: traced through AOTAutograd again on every start, however warm the caches
#: (~45% of a warm vLLM bucket).  A factory's result depends only on its
#: arguments, which the cache key holds; Inductor's
#: ``unsafe_marked_cacheable_functions`` is the public knob for such functions
#: (the value is part of the key: bump it to drop what was cached).  No random
#: factory is listed.
CACHEABLE_FACTORIES = {
    f"torch.{name}": "torch_spyre-1"
    for name in (
        "empty", "empty_strided", "empty_like", "zeros", "zeros_like",
        "ones", "ones_like", "full", "full_like", "arange",
    )
}  # fmt: skip


def mark_cacheable_factories() -> None:
    """Add ``CACHEABLE_FACTORIES`` to Inductor's cacheable functions (what a
    user put there stays)."""
    from torch._inductor import config

    marked = getattr(config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        for name, key in CACHEABLE_FACTORIES.items():
            marked.setdefault(name, key)


def register() -> None:
    """The Inductor backend, device interface and device op overrides for spyre."""
    global _registered
    if _registered:
        return
    mark_cacheable_factories()
    from torch._inductor.codegen.common import (
        register_backend_for_device,
        register_device_op_overrides,
    )

    from torch_spyre.compiler.aoti import SpyreAotWrapperCodegen
    from torch_spyre.compiler.passes import SpyreGraphPass
    from torch_spyre.compiler.scheduling import (
        SpyreDeviceOpOverrides,
        SpyreScheduling,
        SpyreWrapperCodegen,
    )

    register_interface()
    register_backend_for_device(
        "spyre",
        SpyreScheduling,
        SpyreWrapperCodegen,
        SpyreAotWrapperCodegen,
        device_custom_pass=SpyreGraphPass(),
    )
    register_device_op_overrides("spyre", SpyreDeviceOpOverrides())
    _register_storage_offset_lowering()
    _register_plain_scalar_arithmetic()
    _registered = True


def _register_plain_scalar_arithmetic() -> None:
    """Inductor's lowerings of Python's arithmetic operators on sizes
    (``operator.mod`` and the other magic methods) compute with sympy's
    functions, and fail when every argument is a plain int (``_sympy_mod``:
    "'int' object has no attribute 'is_nonnegative'"): a graph whose sizes
    this backend specialised (a lane table's, a pad's) re-propagates its size
    arithmetic to ints (``torch.roll``'s index arithmetic, fuzzer
    ``--dynamic`` long seed 5490, an aborted compile).  Plain ints are
    computed with the operator itself; anything symbolic goes to Inductor's
    lowering.  No public hook wraps a lowering: ``lowerings`` is Inductor's
    own registry (pinned in tests/compiler/test_fuzz_found.py)."""
    import operator

    from torch._inductor import lowering

    # arithmetic only: a comparison's lowering returns sympy's booleans
    arithmetic = (operator.add, operator.sub, operator.mul, operator.truediv,
                  operator.floordiv, operator.mod, operator.pow, operator.neg)  # fmt: skip
    for op in arithmetic:
        inner = lowering.lowerings.get(op)
        if inner is None or getattr(inner, "_spyre_plain", False):
            continue

        def plain(*args, _inner=inner, _op=op, **kwargs):
            if not kwargs and all(type(a) in (int, float, bool) for a in args):
                return _op(*args)
            return _inner(*args, **kwargs)

        plain._spyre_plain = True  # type: ignore[attr-defined]
        lowering.lowerings[op] = plain


def _register_storage_offset_lowering() -> None:
    """A lowering of ``aten.sym_storage_offset`` as Inductor lowers
    ``sym_size`` and ``sym_stride``: the FX node's symbolic value.

    Inductor registers none for it (torch 2.13 and 2.14), and an in-place op
    on a view of a graph input under dynamic shapes (an ``index_put`` on a
    transposed slice, made in place by ``passes._index_put_in_place``) is
    decomposed with the view's storage offset as such a node: without a
    lowering its value reached ``as_strided`` as 0 and the result was read
    from the wrong elements, **a silent wrong answer** (fuzzer ``--dynamic``,
    long seed 3102; pinned in tests/compiler/test_fuzz_found.py).  No public
    hook adds a lowering: ``register_lowering`` is Inductor's own registry.
    Device-independent (the value is the node's), and left alone if a later
    torch registers one."""
    import torch
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    op = torch.ops.aten.sym_storage_offset.default
    if op in lowering.lowerings:
        return

    @lowering.register_lowering(op)
    def sym_storage_offset(a):
        val = V.graph.current_node.meta["val"]
        return val.node.expr if isinstance(val, torch.SymInt) else int(val)


#: module -> what to register once it has loaded (Inductor's compile_fx is
#: loaded before any graph is lowered, after the scheduler and wrapper modules)
_TRIGGERS = {
    "torch._dynamo.device_interface": register_interface,
    "torch._inductor.compile_fx": register,
}


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the backend right after Dynamo/Inductor load, so that
    ``import torch_spyre`` does not pay for importing Inductor (~1.7 s)."""

    def find_spec(self, name, path, target=None):
        if name not in _TRIGGERS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                run = loader.exec_module

                def exec_module(module, _run=run, _then=_TRIGGERS[name]):
                    _run(module)
                    _then()

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def install() -> None:
    """Register now if Dynamo and Inductor are loaded, else as soon as they are."""
    for mod, then in _TRIGGERS.items():
        if mod in sys.modules:
            then()
    if not _registered and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


__all__ = ["backend_version", "install", "register"]
