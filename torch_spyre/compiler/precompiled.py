"""A module's compiled forward, saved whole and loaded without tracing.

With every cache warm, ``torch.compile`` still runs Dynamo in each new
process: it traces the model's bytecode again before its FX graph and
AOTAutograd caches hit (5-6 s of the README main job's 10-12 s warm compile
phase, docs/compiler.md).  Torch's ahead-of-time Dynamo compile
(``torch.compile(...).aot_compile``, experimental in torch 2.13) keeps what a
trace produced: the transformed bytecode, its guards and the compiled graph,
serialisable.  ``PrecompiledForward`` is ``models.prepare(compile=True)``'s
forward on top of it:

* a call is described by its arguments (tensors by shape, stride, dtype and
  device; numbers, strings and None by value; a transformers cache by its
  class and its layers' classes and tensors) and keyed together with the
  module (its class tree, its parameters' and buffers' names, shapes, dtypes
  and devices, its config), the versions of torch, transformers and
  torch_spyre's sources, the hardware config and the planning options;
* the first call of a key compiles it ahead of time and stores it in
  ``TORCH_SPYRE_CACHE_DIR`` (``runtime/artifact_cache``: atomic writes,
  checksummed, capped); a later process loads it instead of tracing.  The weights are graph inputs, read
  from the module at each call, never baked in.

Torch cannot serialise guards on object identity (the cache object, the
module classes, the closures of transformers' forward decorators) nor global
guards, so the saved function keeps only the others: every tensor's shape,
stride, dtype and device (the parameters' too), grad mode, the constants the
trace read from the config.  The key stands for what was left out, and each
call compares the module's class tree with the one the entry was made for.
A call the kept guards or that check refuse runs ``torch.compile``'s own
path, as does everything this path cannot do (a graph break, an argument it
cannot describe, a function that does not pickle, an older or newer torch
without the API): ``stats`` says which and why.  The choice never changes a
result: both run the same compiled graph (tests/compiler/test_precompiled.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_spyre import settings
from torch_spyre.runtime import artifact_cache, cards
from torch_spyre.sim import card

#: the artifact cache's namespace of saved forwards
NAMESPACE = "forward"

#: a saved function's globals that Dynamo installs by object id (modules it
#: loads by name in its bytecode, ``codegen.create_load_python_module``)
_MODULE_GLOBAL = "___module_"


class _Refused(Exception):
    """This call cannot take the precompiled path (the reason)."""


@dataclass
class Stats:
    """What one ``PrecompiledForward`` did, per call description."""

    loaded: int = 0  # entries read from the cache directory
    built: int = 0  # compiled ahead of time in this process
    saved: int = 0
    calls: int = 0  # calls that ran a precompiled function
    plain: int = 0  # calls that ran torch.compile's own path
    why: dict[str, str] = field(default_factory=dict)  # why a description went plain

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Entry:
    fn: Any  # torch._dynamo.aot_compile.AOTCompiledFunction
    classes: tuple[type, ...]


def _serializable_guards(entries) -> list[bool]:
    """``guard_filter_fn``: keep the guards torch can serialise (the key and
    the class check stand for the others, module docstring)."""
    from torch._dynamo.guards import CheckFunctionManager

    bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    keep = []
    for g in entries:
        derived = set(getattr(g, "derived_guard_types", ()) or ())
        # a guard on an object's class or name reaches an object the saved
        # guard state does not hold (the module is saved without its classes)
        reaches_object = any(k in g.name for k in ("__class__", "__name__", "__code__",
                                                   "__closure__", "__dict__"))  # fmt: skip
        keep.append(not (g.is_global or g.guard_type in bad or derived & bad or reaches_object))
    return keep


def _card_clocks() -> tuple[float, ...]:
    """Every card's modelled clock: work billed to a call moves one."""
    return tuple(cards.card(i).clock_s for i in range(cards.num_cards()))


class PrecompiledForward:
    """``module.forward`` compiled by ``backend``, each call description once:
    loaded from the cache directory, else compiled ahead of time and saved,
    else ``torch.compile(forward, backend=backend, dynamic=False)``."""

    def __init__(self, module: torch.nn.Module, backend, forward=None, retry=None) -> None:
        self._module = module
        self._forward = module.forward if forward is None else forward
        self._plain = torch.compile(self._forward, backend=backend, dynamic=False)
        self._backend = backend
        #: called with a compile's exception: True when it changed the module
        #: so that compiling again may succeed (models.prepare: the layer
        #: regions undone when Dynamo cannot capture one), once per forward
        self._retry = retry
        self._aot = None
        self._entries: dict[str, _Entry | None] = {}
        self._lock = threading.Lock()
        self.stats = Stats()
        functools.update_wrapper(self, self._forward)

    def __deepcopy__(self, memo: dict) -> PrecompiledForward:
        # a copy of the module gets a forward of its own over the copy (its
        # entries are made or loaded again: they hold no per-module state)
        module = memo.get(id(self._module), self._module)
        fn = getattr(self._forward, "__func__", None)
        forward = self._forward if fn is None else types.MethodType(fn, module)
        return PrecompiledForward(module, self._backend, forward, self._retry)

    def __reduce__(self):
        # the module's __dict__ holds this forward, and a saved guard state
        # pickles the module: it needs none of this object's state (a lock,
        # compiled functions), only something in its place
        return (str, ("a precompiled forward",))

    # ------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # inside a user's own torch.compile
            return self._forward(*args, **kwargs)
        entry = self._entry(args, kwargs)
        if entry is not None:
            module = self._module
            if entry.classes == _classes(module) and entry.fn.guard_check(module, *args, **kwargs):
                self.stats.calls += 1
                before = _card_clocks()
                try:
                    return entry.fn(module, *args, **kwargs)
                except Exception as e:
                    if _card_clocks() != before:
                        raise
                    # failed before any work on the card (a graph whose inputs
                    # are not this call's): dropped for this process, and the
                    # call takes torch.compile's own path
                    for k, v in self._entries.items():
                        if v is entry:
                            self._entries[k] = None
                    self.stats.calls -= 1
                    self.stats.why["(loaded entry)"] = (
                        f"failed before running ({type(e).__name__}: {first_line(e)})"
                    )
        self.stats.plain += 1
        if self._retry is None:
            return self._plain(*args, **kwargs)
        before = _card_clocks()
        try:
            return self._plain(*args, **kwargs)
        except Exception as e:
            # compiled again only when the failed call did nothing on the
            # card (the compile raised before any graph or eager kernel of
            # this call ran): the second call repeats no cache write
            if _card_clocks() != before or not self._retry(e):
                raise
            self._retry = None
            self._entries.clear()  # described for the module as it was
            return self._plain(*args, **kwargs)

    def _entry(self, args: tuple, kwargs: dict) -> _Entry | None:
        if not settings.get().precompile or artifact_cache.root() is None:
            return None
        try:
            desc = _describe_call(args, kwargs)
        except _Refused as e:
            self.stats.why.setdefault("(arguments)", str(e))
            return None
        key = json.dumps(desc, sort_keys=True)
        try:
            return self._entries[key]
        except KeyError:
            pass
        with self._lock:
            if key not in self._entries:
                entry = None
                try:
                    entry = self._obtain(desc, args, kwargs)
                except _Refused as e:
                    self.stats.why[_brief(desc)] = str(e)
                self._entries[key] = entry
            return self._entries[key]

    # ---------------------------------------------------------- load, build
    def _obtain(self, desc: Any, args: tuple, kwargs: dict) -> _Entry:
        module = self._module
        try:
            cache_key = artifact_cache.key_of(NAMESPACE, [desc, _module_key(module)])
        except (artifact_cache.Uncacheable, TypeError, ValueError) as e:
            raise _Refused(f"the module has no stable key ({e})") from e
        classes = _classes(module)
        saved = artifact_cache.load(NAMESPACE, cache_key)
        if isinstance(saved, dict) and "plain" in saved:  # an earlier process found no way
            raise _Refused(saved["plain"])
        if saved is not None:
            try:
                with card.compiling():  # what loading runs on the card is not the user's call
                    fn = self._deserialize(saved)
                fn.disable_guard_check()  # checked in __call__, with the class check
                self.stats.loaded += 1
                return _Entry(fn, classes)
            except Exception as e:  # noqa: BLE001 - any failure: rebuild it
                artifact_cache.discard(NAMESPACE, cache_key,
                                       f"does not load ({type(e).__name__}: {e})")  # fmt: skip
        try:
            with card.compiling():
                fn = self._compile_ahead(args, kwargs)
        except Exception as e:  # noqa: BLE001 - a graph break, an unsupported guard...
            why = f"not compiled ahead of time ({type(e).__name__}: {first_line(e)})"
            if isinstance(e, torch._dynamo.exc.Unsupported):
                # a graph break is the code's: a later process need not try
                # again (anything else may be this process's, and is retried)
                artifact_cache.store(NAMESPACE, cache_key, {"plain": why})
            raise _Refused(why) from e
        self.stats.built += 1
        try:
            # saving reads the graph's constants back from the card: unbilled,
            # as compiling is (the first call is billed as a loaded one's)
            with card.compiling():
                blob = self._serialize(fn)
        except Exception as e:  # noqa: BLE001 - kept in memory for this process
            self.stats.why[_brief(desc)] = f"not saved ({first_line(e)})"
        else:
            self.stats.saved += int(artifact_cache.store(NAMESPACE, cache_key, blob))
        fn.disable_guard_check()
        return _Entry(fn, classes)

    def _compile_ahead(self, args: tuple, kwargs: dict):
        if self._aot is None:
            self._aot = torch.compile(
                self._forward,
                backend=self._backend,
                dynamic=False,
                fullgraph=True,
                options={"guard_filter_fn": _serializable_guards},
            )
        compile_ahead = getattr(self._aot, "aot_compile", None)
        if compile_ahead is None:
            raise _Refused(f"torch {torch.__version__} has no torch.compile(...).aot_compile")
        return compile_ahead((args, kwargs))

    def _globals(self) -> dict:
        fn = getattr(self._forward, "__func__", self._forward)
        return fn.__globals__

    def _serialize(self, fn) -> dict:
        result = type(fn).serialize(fn, _external_functions(self._module))
        scope = self._globals()
        modules = {name: value.__name__ for name, value in scope.items()
                   if name.startswith(_MODULE_GLOBAL) and isinstance(value, types.ModuleType)}  # fmt: skip
        return {"data": result.serialized_data, "modules": modules}

    def _deserialize(self, saved: dict):
        scope = dict(self._globals())
        for name, mod in saved["modules"].items():
            scope[name] = sys.modules.get(mod) or importlib.import_module(mod)
        return torch.compiler.load_compiled_function(
            io.BytesIO(saved["data"]),
            f_globals=scope,
            external_data=_external_functions(self._module),
        )


# ------------------------------------------------------------------ describing
def _describe_call(args: tuple, kwargs: dict) -> list:
    return [[_describe(a) for a in args], [[k, _describe(v)] for k, v in sorted(kwargs.items())]]


def _brief(desc: list) -> str:
    """A call's description in a line: its tensors' shapes, by argument."""
    args, kwargs = desc
    parts = [(str(i), d) for i, d in enumerate(args)] + [(k, d) for k, d in kwargs]
    return ", ".join(f"{k}{d[1]}" if d[0] == "T" else f"{k}={d[0]}" for k, d in parts)


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return [type(value).__name__, value]
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise _Refused(f"a {type(value).__name__} argument")
        return ["T", list(value.shape), list(value.stride()), value.storage_offset(),
                str(value.dtype), str(value.device), value.requires_grad]  # fmt: skip
    if isinstance(value, tuple | list):
        return [type(value).__name__, [_describe(v) for v in value]]
    layers = getattr(value, "layers", None)
    if type(value).__module__.startswith("transformers.") and isinstance(layers, list):
        # a transformers cache: its class and its layers' (the trace reads them)
        return ["cache", _qualname(type(value)), [_describe_layer(layer) for layer in layers]]
    raise _Refused(f"a {_qualname(type(value))} argument has no description")


def _describe_layer(layer: Any) -> list:
    state = {}
    for name, v in sorted(vars(layer).items()):
        if isinstance(v, torch.Tensor):
            state[name] = _describe(v)
        elif v is None or isinstance(v, bool | int | float | str):
            state[name] = v
    return [_qualname(type(layer)), state]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _classes(module: torch.nn.Module) -> tuple[type, ...]:
    return tuple(type(m) for m in module.modules())


def _module_key(module: torch.nn.Module) -> list:
    """What the saved guards cannot check of ``module``, and the versions."""
    h = hashlib.sha256()
    for name, m in module.named_modules():
        h.update(f"{name}:{_qualname(type(m))}:{m.training};".encode())
    for kind, items in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, t in items:
            h.update(
                f"{kind}{name}:{list(t.shape)}:{t.dtype}:{t.device}:{t.requires_grad};".encode()
            )
    config = getattr(module, "config", None)
    if config is not None:
        to_json = getattr(config, "to_json_string", None)
        text = to_json(use_diff=False) if to_json else repr(vars(config))
        h.update(text.encode())
        h.update(str(getattr(config, "_attn_implementation", None)).encode())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from torch_spyre.kernels import options
    from torch_spyre.runtime import cards

    # Inductor's cache directory too: a compile made to bypass its caches
    # (``fresh_cache``, another TORCHINDUCTOR_CACHE_DIR) bypasses these
    return [h.hexdigest(), torch.__version__, _version_of("transformers"), _models_version(),
            options.current().key(), sorted(cards.config(0).to_dict().items(), key=str),
            cache_dir()]  # fmt: skip


def _version_of(name: str) -> str | None:
    mod = sys.modules.get(name)
    return getattr(mod, "__version__", None)


@functools.cache
def _models_version() -> str:
    """torch_spyre's model adapters (they shape the trace; the compiler's
    sources are in ``artifact_cache.code_version``), once per process."""
    return artifact_cache.sources_hash("models")


def _external_functions(module: torch.nn.Module) -> dict[str, Any]:
    """Every function of the module classes' ``forward`` chains (decorators'
    closures and ``__wrapped__``), by a name stable across processes: the
    saved function refers to them, and a decorated function cannot be
    pickled by its name (the name is the decorator's wrapper's)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(f: Any, name: str) -> None:
        if id(f) in seen or not isinstance(f, types.FunctionType):
            return
        seen.add(id(f))
        out[name] = f
        for i, cell in enumerate(f.__closure__ or ()):
            try:
                walk(cell.cell_contents, f"{name}.c{i}")
            except ValueError:  # an empty cell
                pass
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            walk(wrapped, f"{name}.w")

    for cls in dict.fromkeys(type(m) for m in module.modules()):
        walk(cls.__dict__.get("forward"), f"{_qualname(cls)}.forward")
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def summary(module: torch.nn.Module) -> dict[str, Any] | None:
    """The ``Stats`` of ``module``'s precompiled forward, or None."""
    fwd = module.__dict__.get("forward")
    return fwd.stats.as_dict() if isinstance(fwd, PrecompiledForward) else None


__all__ = ["NAMESPACE", "PrecompiledForward", "Stats", "summary"]
