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

import contextlib
import functools
import hashlib
import importlib
import io
import json
import sys
import threading
import types
from collections.abc import Callable
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
    checks: list = field(default_factory=list)  # _ValueChecks.compiled()


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


#: guards that compare a value the trace read (a flag, a size, a rank)
_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH", "SEQUENCE_LENGTH")
#: code a value guard may pin (a decorator's closure, a function's __code__)
_CODE = (types.CodeType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.ModuleType, type)  # fmt: skip
#: values such a guard holds that an entry can keep and compare
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _ValueChecks:
    """``guard_filter_fn``: the serialisable guards (``_serializable_guards``)
    are kept in torch's saved state; of the value guards it drops (a global
    flag: the LoRA path's ``_step_has_lora``; a module attribute reached
    through ``__dict__``; a rank), each is recorded as (kind, the guard's
    source expression, the value the trace read) and checked by the entry
    at every call (``failed``): without them a saved vLLM forward traced
    with no LoRA step ran LoRA steps without their adapters, a silent wrong
    answer.  A value that is code (a decorator's closure, a function's
    ``__code__``) is the key's to stand for, as the classes are; any other
    dropped value guard whose value cannot be kept refuses the saved path
    (``unchecked``)."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, str, Any]] = []
        self.unchecked: list[str] = []

    def __call__(self, entries) -> list[bool]:
        keep = _serializable_guards(entries)
        for g, kept in zip(entries, keep, strict=True):
            if kept or g.guard_type not in _VALUE_GUARDS:
                continue
            value = g.value if g.has_value else None
            if isinstance(value, _CODE):
                continue  # which code ran: the key stands for it (versions, sources, classes)
            if g.has_value and g.guard_type == "SEQUENCE_LENGTH" and hasattr(value, "__len__"):
                self.recorded.append(("len", g.name, len(value)))
            elif g.has_value and g.guard_type != "SEQUENCE_LENGTH" and _plain(value):
                self.recorded.append(("eq", g.name, value))
            else:
                self.unchecked.append(f"{g.guard_type} {g.name}")
        return keep

    @staticmethod
    def compiled(recorded: list) -> list:
        return [
            (kind, name, compile(name, "<guard>", "eval"), want) for kind, name, want in recorded
        ]

    @staticmethod
    def failed(checks: list, f_locals: dict, scope: dict) -> str | None:
        """The first recorded value this call's state does not have (None: all hold)."""
        names = {**f_locals, "L": f_locals, "G": _GlobalScope(scope)}
        for kind, name, code, want in checks:
            try:
                got = eval(code, {"__builtins__": _GUARD_BUILTINS}, names)  # noqa: S307 - Dynamo's own guard source
                if kind == "len":
                    got = len(got)
            except Exception as e:  # noqa: BLE001 - the state changed shape: refused
                return f"{name} ({type(e).__name__})"
            if type(got) is not type(want) or got != want:
                return f"{name} is {got!r}, the trace read {want!r}"
        return None


def _plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


#: what Dynamo's guard sources call
_GUARD_BUILTINS = {"dict": dict, "type": type, "len": len, "getattr": getattr, "list": list,
                   "tuple": tuple, "isinstance": isinstance}  # fmt: skip


class _GlobalScope(dict):
    """Dynamo's ``G[...]`` of a guard source: the forward's globals, and the
    modules Dynamo loads by name (``__import_torch_dot_nn`` is torch.nn)."""

    def __init__(self, scope: dict) -> None:
        super().__init__()
        self._scope = scope

    def __missing__(self, key: str) -> Any:
        if key in self._scope:
            return self._scope[key]
        if key.startswith("__import_"):
            return importlib.import_module(key.removeprefix("__import_").replace("_dot_", "."))
        raise KeyError(key)


#: values torch saves by name, whatever the guards hold
_SINGLETONS = (torch.dtype, torch.device, torch.layout, torch.memory_format)


@contextlib.contextmanager
def _singletons_saved():
    """Torch's saved guard state (``GuardsStatePickler``, torch 2.13) marks a
    module's attribute the guards do not hold as missing *by its id*, and
    then pickles every occurrence of that object as missing: a vLLM layer's
    ``self.dtype = torch.float16`` made every fp16 tensor of the state load
    without a dtype ("empty_strided(): argument 'dtype' must be torch.dtype,
    not _Missing").  dtypes, devices, layouts and memory formats are
    singletons torch pickles by name: saved as such here.  No public hook
    reaches the pickler; tests/vllm/test_vllm_saved_trace.py fails if this
    stops working (the saved forward of a vLLM model does not load)."""
    from torch._dynamo.guards import GuardsStatePickler

    reduce = GuardsStatePickler.reducer_override

    def reducer_override(self, obj):
        if isinstance(obj, _SINGLETONS):
            return NotImplemented
        return reduce(self, obj)

    GuardsStatePickler.reducer_override = reducer_override
    try:
        yield
    finally:
        GuardsStatePickler.reducer_override = reduce


def _card_clocks() -> tuple[float, ...]:
    """Every card's modelled clock: work billed to a call moves one."""
    return tuple(cards.card(i).clock_s for i in range(cards.num_cards()))


class PrecompiledForward:
    """``module.forward`` compiled by ``backend``, each call description once:
    loaded from the cache directory, else compiled ahead of time and saved,
    else ``torch.compile(forward, backend=backend, dynamic=False)``."""

    def __init__(
        self,
        module: torch.nn.Module,
        backend,
        forward=None,
        retry=None,
        fullgraph: bool = False,
        salt: Any = None,
        dynamic: Callable[[tuple, dict], list[tuple[torch.Tensor, int]]] | None = None,
    ) -> None:
        self._module = module
        self._forward = module.forward if forward is None else forward
        self._plain = torch.compile(
            self._forward, backend=backend, dynamic=False, fullgraph=fullgraph
        )
        self._backend = backend
        self._fullgraph = fullgraph
        #: what else keys the saved functions (vLLM's config hash: vllm_plugin)
        self._salt = salt
        #: a call's (tensor, dim) pairs traced as symbols (vLLM's token count):
        #: one saved function serves every size of them.  Marked only when
        #: this traces: torch 2.13's saved guards lose the marks, and then
        #: refuse a marked call ("_has_dynamo_dim_marking is present on
        #: runtime tensor but was absent at compile time")
        self._dynamic = dynamic
        #: called with a compile's exception: True when it changed the module
        #: so that compiling again may succeed (models.prepare: the layer
        #: regions undone when Dynamo cannot capture one), once per forward
        self._retry = retry
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
        return PrecompiledForward(
            module, self._backend, forward, self._retry, self._fullgraph, self._salt, self._dynamic
        )

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
            if self._admits(entry, args, kwargs):
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
        self._mark(args, kwargs)
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

    def _dims(self, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
        return [] if self._dynamic is None else self._dynamic(args, kwargs)

    def _mark(self, args: tuple, kwargs: dict) -> None:
        for t, dim in self._dims(args, kwargs):
            torch._dynamo.maybe_mark_dynamic(t, dim)

    def _admits(self, entry: _Entry, args: tuple, kwargs: dict) -> bool:
        """The entry serves this call (its class check and kept guards pass);
        why not, in ``stats.why``."""
        module = self._module
        if entry.classes != _classes(module):
            self.stats.why["(loaded entry)"] = "the module's classes differ"
            return False
        if not entry.fn.guard_check(module, *args, **kwargs):
            f_locals = entry.fn.prepare_f_locals(module, *args, **kwargs)
            reason = entry.fn._artifacts.guard_manager.check_verbose(f_locals)
            self.stats.why["(loaded entry)"] = f"guards refuse the call: {str(reason)[:600]}"
            return False
        if not entry.checks:
            return True
        f_locals = entry.fn.prepare_f_locals(module, *args, **kwargs)
        changed = _ValueChecks.failed(entry.checks, f_locals, self._globals())
        if changed is not None:
            self.stats.why["(loaded entry)"] = f"a value the trace read changed: {changed}"
            return False
        return True

    def _entry(self, args: tuple, kwargs: dict) -> _Entry | None:
        if not settings.get().precompile or artifact_cache.root() is None:
            return None
        try:
            desc = _describe_call(args, kwargs, {id(t): d for t, d in self._dims(args, kwargs)})
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
            cache_key = artifact_cache.key_of(NAMESPACE, [desc, _module_key(module), self._salt])
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
                checks = _ValueChecks.compiled(saved.get("checks", []))
                self.stats.loaded += 1
                return _Entry(fn, classes, checks)
            except Exception as e:  # noqa: BLE001 - any failure: rebuild it
                artifact_cache.discard(NAMESPACE, cache_key,
                                       f"does not load ({type(e).__name__}: {e})")  # fmt: skip
        values = _ValueChecks()
        try:
            with card.compiling():
                fn = self._compile_ahead(args, kwargs, values)
        except Exception as e:  # noqa: BLE001 - a graph break, an unsupported guard...
            why = f"not compiled ahead of time ({type(e).__name__}: {first_line(e)})"
            if isinstance(e, torch._dynamo.exc.Unsupported):
                # a graph break is the code's: a later process need not try
                # again (anything else may be this process's, and is retried)
                artifact_cache.store(NAMESPACE, cache_key, {"plain": why})
            raise _Refused(why) from e
        if values.unchecked:  # the code's too: remembered
            why = ("the trace read values a saved forward cannot check: "
                   + ", ".join(values.unchecked[:3]))  # fmt: skip
            artifact_cache.store(NAMESPACE, cache_key, {"plain": why})
            raise _Refused(why)
        self.stats.built += 1
        try:
            # saving reads the graph's constants back from the card: unbilled,
            # as compiling is (the first call is billed as a loaded one's)
            with card.compiling():
                blob = self._serialize(fn)
                blob["checks"] = values.recorded
        except Exception as e:  # noqa: BLE001 - kept in memory for this process
            self.stats.why[_brief(desc)] = f"not saved ({first_line(e)})"
        else:
            self.stats.saved += int(artifact_cache.store(NAMESPACE, cache_key, blob))
        fn.disable_guard_check()
        return _Entry(fn, classes, _ValueChecks.compiled(values.recorded))

    def _compile_ahead(self, args: tuple, kwargs: dict, values: _ValueChecks):
        aot = torch.compile(
            self._forward,
            backend=self._backend,
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": values},
        )
        compile_ahead = getattr(aot, "aot_compile", None)
        if compile_ahead is None:
            raise _Refused(f"torch {torch.__version__} has no torch.compile(...).aot_compile")
        self._mark(args, kwargs)
        with _singletons_saved():
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
def _describe_call(args: tuple, kwargs: dict, dynamic: dict[int, int] | None = None) -> list:
    """``dynamic``: a tensor's symbolic dim by the tensor's id (its size and
    the strides are described as "*")."""
    dynamic = dynamic or {}

    def one(v: Any) -> Any:
        desc = _describe(v)
        dim = dynamic.get(id(v))
        if dim is not None:
            desc[1] = ["*" if i == dim else n for i, n in enumerate(desc[1])]
            desc[2] = ["*"] * len(desc[2])
        return desc

    return [[one(a) for a in args], [[k, one(v)] for k, v in sorted(kwargs.items())]]


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
