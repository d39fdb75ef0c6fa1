"""A graph Dynamo traced, saved for a later process to compile again without
tracing (vLLM's forward, traced once with a symbolic token count:
``vllm_plugin/compile.PerBucket``).

What is kept is what compiling it per size needs: the graph, and the fake
values (``example_value``, symbolic shapes) of its inputs and of every value
that crosses a cut (``compile_piecewise`` hands those to each piece).  The
rest of Dynamo's node metadata (module stacks, source functions, the graph
arguments' sources, which hold the model's layers) is dropped: it does not
pickle.  SmolLM2's forward keeps 916 of its 2,363 fake values and loads in
0.14 s (0.18-0.27 s with one on every node; measured as a second load in a
process: a process's first load pays ~0.5 s more either way).  Torch's
``GraphPickler`` does the pickling; a saved graph is loaded into a fresh
fake mode and shape environment.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from torch_spyre.compiler import piecewise


class _Pickler(GraphPickler):
    def reducer_override(self, obj):
        # torch's sympy functions (FloorDiv, Mod, ...) by their handler's name
        if (
            inspect.isclass(obj)
            and issubclass(obj, sympy.Function)
            and hasattr(obj, "_torch_unpickler")
        ):
            return obj._torch_unpickler, (obj._torch_handler_name,)
        if isinstance(obj, FakeTensorMode):  # loads gives the values a mode of its own
            return type(None), ()
        return super().reducer_override(obj)


def _kept(gm: torch.fx.GraphModule, is_cut: Callable[[torch.fx.Node], bool]) -> set:
    """The nodes whose fake values a per-size compile reads: the inputs,
    every value used in another part than its own (``piecewise.parts``) and
    the receivers of method calls."""
    part = piecewise.parts(gm, is_cut)
    kept = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(part.get(u) != part.get(n) for u in n.users):
            kept.add(n)
        if n.op == "call_method" and isinstance(n.args[0], torch.fx.Node):
            # AOTAutograd's cache takes a method call on a node with a fake
            # value only (it bypasses the cache otherwise)
            kept.add(n.args[0])
    return kept


def dumps(gm: torch.fx.GraphModule, is_cut: Callable[[torch.fx.Node], bool]) -> bytes:
    """``gm`` (left as it is) as bytes: a copy with the metadata ``loads`` needs."""
    copy = piecewise.fresh(gm)
    piecewise.share_lookups(copy)  # what compile_piecewise will cut: idempotent
    kept = _kept(copy, is_cut)
    for n in copy.graph.nodes:
        value = n.meta.get("example_value") if n in kept else None
        n.meta = {} if value is None else {"example_value": value}
    copy.meta = {}
    return _Pickler.dumps(copy, Options(ops_filter=None))


def loads(data: bytes) -> torch.fx.GraphModule:
    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"a saved graph loaded as a {type(gm).__name__}")
    return gm


__all__ = ["dumps", "loads"]
