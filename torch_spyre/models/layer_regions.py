"""A Hugging Face decoder's layers traced once under ``torch.compile``.

Dynamo traces a model's forward bytecode by bytecode: SmolLM2's 30 layers
are ~3.7 s of every process's start, for each graph (prefill and decode),
warm cache or not.  ``torch.compiler.nested_compile_region`` lets Dynamo
trace a layer once and stamp it out for every other layer
(``compiler/regions.py``), but a transformers layer writes its KV cache as
``cache.update(k, v, self.layer_idx)``: a Python object indexed by a
per-layer constant, which no two layers' regions could share.

So each marked layer hands its region its own cache tensors instead: the
static cache layer's ``keys``, ``values`` and ``cumulative_length``, as
tensor arguments.  Inside the region a one-layer view of them
(``_LayerCache``) takes the layer's ``cache.update(...)`` and does what
transformers' ``StaticLayer.update`` does, in place on those tensors: write
the new keys and values at the layer's position and advance it.  The
region then depends on nothing per layer but tensors, and Dynamo traces it
once; ``compiler.regions.inline_subgraphs`` flattens the traced graph again
before Inductor sees it, so the programs, the modelled time and the answer
are those of the flat trace.

A layer is marked only when this is exact (``why_not``):

* every module class inside the layer touches the cache only through
  ``.update(`` of its own layer, ``self.layer_idx`` (read from the source
  of its ``forward``; HRM's recurrent cycles write other layers' slots); a layer that asks
  its cache anything else (a sliding window's offsets, a hybrid's
  recurrent state) is left to be traced on its own, as before;
* at run time, the layer's cache layer is exactly transformers'
  ``StaticLayer``, already initialised (``models.generate`` allocates it up
  front), or there is no cache.  Any other cache (a ``DynamicCache`` of
  ``transformers.generate``, a sliding-window layer) takes the layer's own
  forward, unmarked.

Eager calls of a marked layer are the same computation (the region is a
no-op outside ``torch.compile``).  Measured in ``benchmarks/startup.py
--warm-cache`` (docs/compiler.md).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import re
import textwrap
import warnings

import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from torch_spyre.compiler import regions
from torch_spyre.compiler.precompiled import first_line

#: names a transformers module's forward gives its cache argument
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
_CACHE_USE = re.compile(r"\b(" + "|".join(_CACHE_NAMES) + r")\s*\.\s*(\w+)")


def why_not(layer: nn.Module) -> str | None:
    """None when ``layer`` can be a region over its own cache tensors; else
    the reason it cannot."""
    writers = _cache_writers(layer)
    if isinstance(writers, str):
        return writers
    if len(writers) > 1:
        # LongCat-Flash: two attentions a layer, cache layers 2i and 2i + 1
        return f"{len(writers)} modules of the layer write the cache, not one"
    return None


def _cache_writers(layer: nn.Module) -> list[nn.Module] | str:
    """The modules of ``layer`` whose forward writes the cache (``update``),
    or the reason the layer cannot be a region over its own cache layer."""
    seen: set[type] = set()
    writes: set[type] = set()
    for mod in layer.modules():
        cls = type(mod)
        if cls in seen:
            continue
        seen.add(cls)
        fwd = getattr(cls, "forward", None)
        if fwd is None or cls.__module__.startswith("torch."):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(fwd))
        except (OSError, TypeError):
            return f"the source of {cls.__name__}.forward is not available"
        uses = {m.group(2) for m in _CACHE_USE.finditer(src)}
        if uses - {"update"}:
            return f"{cls.__name__}.forward uses its cache's {sorted(uses - {'update'})}"
        other = _updates_another_layer(src)
        if other is not None:
            return f"{cls.__name__}.forward updates the cache of layer {other}, not self.layer_idx"
        if uses:
            writes.add(cls)
    return [m for m in layer.modules() if type(m) in writes]


def _updates_another_layer(src: str) -> str | None:
    """The layer index of a ``cache.update(k, v, index, ...)`` call in
    ``src`` that is not ``self.layer_idx`` (as source text), or None.  The
    region hands a layer its own cache layer: a layer writing another one
    (HRM's recurrent cycles call the same layers with ``self.layer_idx +
    cycle_offset``) would have its writes land in its own slot instead, a
    wrong cache (an error or, with room in the cache, a wrong answer)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return "? (its source does not parse)"
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in _CACHE_NAMES
        ):
            continue
        idx = next((k.value for k in node.keywords if k.arg == "layer_idx"), None)
        if idx is None:
            idx = node.args[2] if len(node.args) > 2 else None
        if idx is None:
            return "? (no layer index given)"
        if not (
            isinstance(idx, ast.Attribute)
            and idx.attr == "layer_idx"
            and isinstance(idx.value, ast.Name)
            and idx.value.id == "self"
        ):
            return ast.unparse(idx)
    return None


class _LayerCache:
    """One layer's static KV cache inside its region: transformers'
    ``StaticLayer.update`` over the tensors the region was handed."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor) -> None:
        self.keys, self.values, self.length = keys, values, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *_, **__):
        # the layer index is the caller's: this view is that layer's cache
        n = key_states.shape[-2]
        pos = torch.arange(n, device=self.keys.device) + self.length
        self.length.add_(n)
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        return self.keys, self.values


def _flatten(kwargs: dict) -> tuple[str, list] | None:
    """``kwargs`` as a spec string and a flat list of leaves (tensors,
    numbers, None; a tuple of them, as the rotary ``position_embeddings``,
    spread out); None for anything else.  Dynamo reuses a region cheaply
    only when its arguments are leaves: a dict or a tuple argument makes it
    trace ``pytree.tree_flatten`` at every call (~70 ms a layer here)."""
    spec, leaves = [], []
    for name, value in kwargs.items():
        if isinstance(value, tuple):
            if not all(_leaf(v) for v in value):
                return None
            spec.append(f"{name}:{len(value)}")
            leaves.extend(value)
        elif _leaf(value):
            spec.append(name)
            leaves.append(value)
        else:
            return None
    return ",".join(spec), leaves


def _leaf(value) -> bool:
    return value is None or isinstance(value, torch.Tensor | bool | int | float | str)


def _unflatten(spec: str, leaves: tuple) -> dict:
    kwargs, i = {}, 0
    for item in spec.split(",") if spec else ():
        name, _, n = item.partition(":")
        if n:
            kwargs[name] = tuple(leaves[i : i + int(n)])
            i += int(n)
        else:
            kwargs[name] = leaves[i]
            i += 1
    return kwargs


def _region_body(layer, hidden_states, keys, values, length, spec, *leaves):
    cache = None if keys is None else _LayerCache(keys, values, length)
    kwargs = _unflatten(spec, leaves)
    return type(layer)._spyre_layer_of.forward(layer, hidden_states, cache=cache, **kwargs)


#: the region every marked layer class calls (marked once: Dynamo keys its
#: reuse on the function; each call brings its own layer and tensors), with
#: one traced body per distinct layer up to regions.MAX_BODIES
_REGION = torch.compiler.nested_compile_region(_region_body, max_reuse_entries=regions.MAX_BODIES)

#: layer class -> its marked subclass
_CLASSES: dict[type, type] = {}


def _marked_class(cls: type) -> type:
    marked = _CLASSES.get(cls)
    if marked is not None:
        return marked

    def forward(self, hidden_states, *args, **kwargs):
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        flat = None if args else _flatten(kwargs)
        if flat is None:  # positional or structured arguments: the layer's own forward
            return cls.forward(self, hidden_states, *args, cache=cache, **kwargs)
        if cache is None:
            return _REGION(self, hidden_states, None, None, None, flat[0], *flat[1])
        layers = getattr(cache, "layers", None)
        idx = self._spyre_layer_index
        own = layers[idx] if isinstance(layers, list | tuple) and idx < len(layers) else None
        if type(own) is StaticLayer and own.is_initialized:
            return _REGION(
                self, hidden_states, own.keys, own.values, own.cumulative_length, flat[0], *flat[1]
            )
        return cls.forward(self, hidden_states, cache=cache, **kwargs)

    # importable by its name (a precompiled forward's saved guards pickle the
    # classes they meet, and take only a class whose qualified name is its
    # name, compiler/precompiled.py): this module's ``<class>_spyre_<hash>``
    name = f"{cls.__name__}_spyre_{hashlib.sha256(cls.__module__.encode()).hexdigest()[:8]}"
    marked = _CLASSES[cls] = type(
        name,
        (cls,),
        {"forward": forward, "__module__": __name__, "__qualname__": name,
         "_spyre_layer_of": cls},
    )  # fmt: skip
    globals()[name] = marked
    return marked


def mark_layers(model: nn.Module) -> str:
    """Mark the decoder layers of ``model`` (a transformers model) as one
    region over their own cache tensors; what was done, for
    ``model.spyre_patches`` ("" when there is no decoder layer list)."""
    layers = _decoder_layers(model)
    if layers is None:
        return ""
    classes = {type(m) for m in layers}
    if len(classes) != 1:
        return f"layers not marked: {len(classes)} layer classes"
    cls = classes.pop()
    if getattr(cls, "_spyre_layer_of", None) is not None:
        return ""
    reason = why_not(layers[0])
    if reason is not None:
        return f"layers not marked: {reason}"
    marked = _marked_class(cls)
    # the cache layer is the one its writer names (self.layer_idx); the
    # writer's class is the same in every layer (one layer class)
    writers = _cache_writers(layers[0])
    kinds = {type(w) for w in writers} if isinstance(writers, list) else set()
    for i, layer in enumerate(layers):
        writer = next((m for m in layer.modules() if type(m) in kinds), None)
        own = getattr(writer, "layer_idx", None)
        layer._spyre_layer_index = own if isinstance(own, int) else i
        layer.__class__ = marked
    return f"{len(layers)} {cls.__name__}s traced once (one region over each layer's cache)"


def allocate(model: nn.Module, cache, batch: int) -> bool:
    """Allocate ``cache``'s static layers up front (transformers allocates
    them at their first ``update``, inside the first traced graph, where a
    marked layer cannot hand them to its region) when ``model``'s layers are
    marked; whether it did.  The shapes are the config's, checked against
    every layer's key and value projections: anything else (latent
    attention, per-layer head counts) is left to transformers."""
    layers = _decoder_layers(model)
    if layers is None or getattr(type(layers[0]), "_spyre_layer_of", None) is None:
        return False
    own = getattr(cache, "layers", None)
    if not isinstance(own, list) or len(own) != len(layers):
        return False
    if any(type(c) is not StaticLayer or c.is_initialized for c in own):
        return False
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        return False
    for layer in layers:
        attn = layer.self_attn
        for proj in (getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)):
            if not isinstance(proj, nn.Linear) or proj.out_features != kv_heads * head_dim:
                return False
    weight = layers[0].self_attn.k_proj.weight
    cache.early_initialization(batch, kv_heads, head_dim, weight.dtype, weight.device)
    return True


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` of decoder layers: the longest list of the model
    whose members have a ``self_attn`` (transformers' naming)."""
    best = None
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            if all(hasattr(m, "self_attn") for m in mod) and (best is None or len(mod) > len(best)):
                best = mod
    return best


def unmark(model: nn.Module) -> bool:
    """Every marked layer its own class again; whether any was marked."""
    found = False
    for m in model.modules():
        original = type(m).__dict__.get("_spyre_layer_of")
        if original is not None:
            m.__class__ = original
            found = True
    return found


def undo_on(model: nn.Module, error: BaseException) -> bool:
    """After a compile of ``model`` raised ``error``: when Dynamo could not
    capture a layer region whole (an op inside a layer whose output shape
    depends on data, LongCat-Flash's MoE routing: a graph break a region
    cannot take), the layers are unmarked (each traced on its own, graph
    breaks allowed, as without regions) with a warning, and True is
    returned: compile again.  Any other error is the caller's."""
    if not isinstance(error, torch._dynamo.exc.UncapturedHigherOrderOpError):
        return False
    if not unmark(model):
        return False
    model.spyre_patches = [
        p for p in getattr(model, "spyre_patches", []) if not p.startswith("layer_regions:")
    ] + [f"layer_regions: undone (Dynamo cannot capture a layer whole: {first_line(error)})"]
    warnings.warn(
        f"torch_spyre: the decoder layers of {type(model).__name__} are traced one by one: "
        f"Dynamo cannot capture a layer as one region ({first_line(error)})",
        stacklevel=3,
    )
    return True


__all__ = ["allocate", "mark_layers", "undo_on", "unmark", "why_not"]
