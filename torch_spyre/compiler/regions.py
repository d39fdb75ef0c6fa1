"""Repeated layers traced once: PyTorch's nested compile regions, flattened for the planner.

Dynamo traces a model's forward op by op; a 40-layer decoder is 40 layers of
tracing (0.15-0.18 s a layer here), in every process and, without a dynamic
dim, for every shape.  ``torch.compiler.nested_compile_region`` is PyTorch's
public answer: a function so marked is traced once and "stamped out" for
every later call with inputs of the same kind (an ``invoke_subgraph`` node
per call, over one subgraph; a call that cannot reuse it is traced again, so
marking is always safe).

* ``mark_repeated(model)`` marks the layers of every ``nn.ModuleList`` whose
  members share a class (a decoder's layers): each member becomes an
  instance of a subclass whose ``forward`` is the marked class ``forward``,
  so every layer's call is the same region, with its own weights as the
  region's inputs.  Eager calls are unchanged (the marking is a no-op
  outside ``torch.compile``).
* ``inline_subgraphs(gm)`` flattens the traced graph back to one graph
  before lowering: the planner, the graph passes and the piece-by-piece
  compile (``piecewise.py``, which compiles each distinct piece once) see
  the graph they always saw, so the programs, and the modelled time, are
  those of the flat trace.  Flattening is a copy of FX nodes: ~10 ms a
  layer, against the ~0.15 s Dynamo spends tracing one.

Measured in ``benchmarks/startup.py`` (docs/serving.md).
"""

from __future__ import annotations

import hashlib
import operator

import torch

_INVOKE = torch.ops.higher_order.invoke_subgraph

#: distinct traced bodies Dynamo keeps for one region (``max_reuse_entries``;
#: its default is 8): layers that differ in what their trace reads (a sliding
#: and a full layer, a per-layer constant a model's code branches on) are
#: distinct bodies, and Dynamo refuses the whole trace past the cap, so it is
#: above any model's depth
MAX_BODIES = 256


def mark_repeated(model: torch.nn.Module) -> list[str]:
    """Mark the members of ``model``'s lists of same-class layers as one
    nested compile region per class; the names of the lists marked."""
    marked: list[str] = []
    inside: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 2:
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue  # a list inside a marked layer: traced with it
        classes = {type(m) for m in mod}
        if len(classes) != 1 or isinstance(mod[0], torch.nn.ModuleList | torch.nn.ModuleDict):
            continue
        region = _region_class(classes.pop())
        for m in mod:
            m.__class__ = region
        marked.append(name)
        inside.append(name)
    return marked


#: layer class -> its subclass whose forward is a nested compile region
_REGIONS: dict[type, type] = {}


def _region_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` is marked, for this process's
    marked layers only (the model's class is left as it is).  The mark sits
    on the class: Dynamo (torch 2.13) stamps a region bound per instance
    (``layer.forward = MethodType(marked, layer)``) out with the *first*
    layer's weights for every layer, a silent wrong answer; marked on the
    class, each call takes its own layer's (tests/compiler/test_regions.py)."""
    if getattr(cls, "_spyre_region_of", None) is not None:
        return cls
    region = _REGIONS.get(cls)
    if region is None:
        forward = torch.compiler.nested_compile_region(cls.forward, max_reuse_entries=MAX_BODIES)
        # found by pickle under a name of this module (a saved trace pickles
        # the layers' class by reference: compiler/precompiled.py), the same
        # name in every process that marks ``cls`` (torch saves a class only
        # when its __qualname__ is its __name__)
        digest = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}".encode()).hexdigest()
        name = f"{cls.__name__}_region_{digest[:10]}"
        region = _REGIONS[cls] = type(
            name, (cls,), {"forward": forward, "__module__": __name__, "_spyre_region_of": cls}
        )
        globals()[name] = region
    return region


def unmark(model: torch.nn.Module) -> None:
    """Undo ``mark_repeated``: every layer its own class again."""
    for m in model.modules():
        original = type(m).__dict__.get("_spyre_region_of")
        if original is not None:
            m.__class__ = original


def flat_inductor(gm: torch.fx.GraphModule, example_inputs):
    """A ``torch.compile`` backend: Inductor (``compile_fx``, what the default
    backend runs) on ``gm`` with its nested compile regions flattened
    (``inline_subgraphs``), so a model whose layers are regions
    (``models/layer_regions.py``) is planned as its flat trace."""
    from torch._inductor.compile_fx import compile_fx

    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _INVOKE]
    bodies = {n.args[0].target if isinstance(n.args[0], torch.fx.Node) else id(n.args[0])
              for n in calls}  # fmt: skip
    flat_stats.append((len(calls), len(bodies)))
    inline_subgraphs(gm)
    return compile_fx(gm, example_inputs)


#: per graph ``flat_inductor`` compiled: (region calls, distinct traced bodies)
flat_stats: list[tuple[int, int]] = []


def inline_subgraphs(gm: torch.fx.GraphModule) -> int:
    """Replace every ``invoke_subgraph`` call of ``gm`` by a copy of its
    subgraph's nodes over the call's operands (nested calls too); the number
    of calls flattened.  The subgraphs' own attributes (constants) are
    carried over under fresh names."""
    count = 0
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not _INVOKE:
            continue
        sub_attr = node.args[0]
        sub = getattr(gm, sub_attr.target) if isinstance(sub_attr, torch.fx.Node) else sub_attr
        count += 1 + inline_subgraphs(sub)
        operands = node.args[2:]
        env: dict[torch.fx.Node, object] = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise RuntimeError(
                f"spyre: {node.name} passes {len(operands)} operands to a subgraph "
                f"of {len(placeholders)} inputs"
            )
        env.update(zip(placeholders, operands))
        outputs = None
        with g.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = n.args[0]
                    break
                if n.op == "get_attr":
                    env[n] = g.get_attr(_carry_attr(gm, sub, n.target))
                    env[n].meta = dict(n.meta)
                    continue
                env[n] = g.node_copy(n, env.__getitem__)
        results = torch.fx.node.map_arg(outputs, env.__getitem__)
        results = results if isinstance(results, list | tuple) else (results,)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise RuntimeError(
                    f"spyre: {node.name}'s result is used whole by {user.name}, not by index"
                )
            user.replace_all_uses_with(results[user.args[1]])
            g.erase_node(user)
        g.erase_node(node)
    if count:
        for n in list(g.nodes):
            if n.op == "get_attr" and not n.users:
                target = n.target
                g.erase_node(n)
                if not any(m.op == "get_attr" and m.target == target for m in g.nodes):
                    _drop_attr(gm, target)
        g.lint()
        gm.recompile()
    return count


def _carry_attr(gm: torch.fx.GraphModule, sub: torch.nn.Module, target: str) -> str:
    value = operator.attrgetter(target)(sub)
    name, i = f"_inlined_{target.replace('.', '_')}", 0
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    name = f"{name}_{i}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name


def _drop_attr(gm: torch.fx.GraphModule, target: str) -> None:
    if "." in target:
        return  # inside another module: left in place
    if target in gm._modules:
        del gm._modules[target]
    elif hasattr(gm, target):
        delattr(gm, target)


__all__ = ["flat_inductor", "inline_subgraphs", "mark_repeated", "unmark"]
