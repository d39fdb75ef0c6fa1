"""A scheduler node the planner cannot express runs as eager device kernels.

Inductor lowered the post-grad FX graph into loop IR; a buffer whose loops no
kernel program can express (``degrade.py`` decides) is computed instead by the
FX nodes it came from, run op by op on the card through the eager library
inside the compiled graph.  This module finds those FX nodes: from the
buffer's origin node back through every input that is not a tensor the
wrapper already holds (a graph input, a constant, or a buffer this node reads
that an earlier kernel stored), and writes them as one Python function into
the wrapper module, FX's own code generation.  The wrapper calls it through
``runtime.compiled.run_eager`` and stores the result into the buffer Inductor
allocated.

The eager ops then run as eager ops do: on the card when the eager library
has a kernel, else through the counted host fallback.
"""

from __future__ import annotations

import hashlib
import operator

import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

from torch_spyre.kernels.search import Unsupported

#: names FX's generated code may use, and the runtime gives it
GLOBALS = ("torch", "device", "inf", "nan", "operator", "NoneType")


def origin_node(buf) -> torch.fx.Node | None:
    """The FX node whose value is ``buf`` (Inductor's best-effort tracking;
    when it has none, ``_sink_origin``)."""
    node = getattr(buf, "origin_node", None)
    if node is None and isinstance(buf, ir.ComputedBuffer):
        node = getattr(buf.data, "origin_node", None)
    if node is None and isinstance(getattr(buf, "data", None), ir.Pointwise):
        node = _sink_origin(buf)
    return node


def _sink_origin(buf) -> torch.fx.Node | None:
    """A pointwise buffer Inductor realized while lowering another node (the
    padded input of a reduction, ``var(pad(x))``) has no recorded node, and
    its origins hold that other node (``var``, the one no origin reads).  Its
    value is the last of the remaining origins (``pad``), when that one has
    the buffer's shape and dtype."""
    origins = [o for o in (buf.origins or ()) if o.op == "call_function"]
    read = {a for o in origins for a in o.all_input_nodes}
    lowering = {o for o in origins if o not in read}
    try:
        size = [int(s) for s in buf.get_size()]
    except TypeError:  # symbolic
        return None

    def fits(o) -> bool:
        val = o.meta.get("val")
        return (
            isinstance(val, torch.Tensor)
            and list(val.shape) == size
            and val.dtype == buf.get_dtype()
        )

    rest = [o for o in origins if o not in lowering and fits(o)]
    read = {a for o in rest for a in o.all_input_nodes}
    last = [o for o in rest if o not in read]
    return last[0] if len(last) == 1 else None


def _realized(reads: set[str]) -> dict[torch.fx.Node, str]:
    """FX node -> the wrapper variable of a tensor already computed: graph
    inputs and constants, and the buffers this node reads (stored before it)."""
    out: dict[torch.fx.Node, str] = {}
    graph = V.graph
    for n in graph.module.graph.nodes:
        if n.op == "placeholder" and n.target in graph.graph_inputs:
            out[n] = n.target
        elif n.op == "get_attr" and n.target in graph.constants:
            out[n] = n.target
    removed = graph.removed_buffers
    for buf in graph.buffers:
        name = buf.get_name()
        node = origin_node(buf)
        if node is not None and name in reads and name not in removed:
            out.setdefault(node, name)
    return out


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


_aten = torch.ops.aten
#: FX ops whose value Inductor computes from a welford reduction's buffers
_WELFORD_ORIGINS = (_aten.var_mean.correction, _aten.var.correction, _aten.std.correction)


def _welford(buf):
    """(the FX op whose welford reduction ``buf`` is, the output index: 0 the
    mean, 1 the sum of squared deviations M2, 2 the count), or None.  No FX
    node has these values: the variance is M2 / (n - correction), computed
    in the buffer's readers."""
    data = getattr(buf, "data", None)
    if not isinstance(data, ir.WelfordReduction) or data.reduction_type != "welford_reduce":
        return None
    found = [
        o for o in (buf.origins or ()) if o.op == "call_function" and o.target in _WELFORD_ORIGINS
    ]
    if len(found) != 1:
        return None
    return found[0], data.output_index


def _welford_output(g: torch.fx.Graph, x: torch.fx.Node, fx_op, index: int, size) -> torch.fx.Node:
    """FX nodes computing output ``index`` of the welford reduction of ``fx_op``
    (whose input is ``x`` in ``g``), shaped as the buffer (``size``)."""
    dims = fx_op.args[1] if len(fx_op.args) > 1 else fx_op.kwargs.get("dim")
    if dims is None:
        dims = list(range(len(fx_op.args[0].meta["val"].shape)))
    dims = list(dims)
    call = g.call_function
    mean = call(_aten.mean.dim, (x, dims, True))
    if index == 0:
        out = mean
    elif index == 1:
        dev = call(_aten.sub.Tensor, (x, mean))
        out = call(_aten.sum.dim_IntList, (call(_aten.mul.Tensor, (dev, dev)), dims, True))
    else:
        n = 1
        shape = fx_op.args[0].meta["val"].shape
        for d in dims:
            n *= int(shape[d])
        out = call(_aten.add.Tensor, (call(_aten.mul.Tensor, (mean, 0.0)), float(n)))
    return call(_aten.reshape.default, (out, [int(s) for s in size]))


def function_source(snode) -> tuple[str, str, list[str]]:
    """(name, Python source of a function computing ``snode``'s buffer with
    eager ops, the wrapper variables to call it with).  Unsupported when the
    buffer's FX nodes cannot be found or re-run (a mutation, an input the
    wrapper does not hold)."""
    buf = snode.node
    name = buf.get_name()
    root = origin_node(buf)
    welford = _welford(buf) if root is None else None
    if welford is not None:
        root = welford[0].args[0]  # the reduction's input: computed eagerly, then reduced
        if not isinstance(root, torch.fx.Node):
            raise Unsupported(f"spyre compiler: {name}: a welford reduction of a constant")
    if root is None or root.op not in ("call_function", "placeholder", "get_attr"):
        raise Unsupported(f"spyre compiler: {name} has no FX node to run eagerly")
    reads = {d.name for d in snode.read_writes.reads}
    held = _realized(reads)
    order: list[torch.fx.Node] = []
    inputs: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def visit(n: torch.fx.Node) -> None:
        if n in seen:
            return
        seen.add(n)
        if n is not root and n in held:
            inputs.append(n)
            return
        if n.op != "call_function":
            raise Unsupported(
                f"spyre compiler: {name} needs {n.name} ({n.op}), which the wrapper does not hold"
            )
        if _mutates(n):
            raise Unsupported(f"spyre compiler: {name} comes from a mutation ({n.target})")
        for a in n.all_input_nodes:
            visit(a)
        order.append(n)

    if welford is not None and root in held:
        seen.add(root)
        inputs.append(root)
    else:
        visit(root)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in{i}")
    for n in order:
        env[n] = g.node_copy(n, lambda a: env[a])
    result = env[root]
    if welford is not None:
        result = _welford_output(g, result, *welford, buf.get_size())
    g.output(result)
    code = g.python_code("self")
    unknown = set(code.globals) - set(GLOBALS) - {"torch", "fx_pytree", "pytree"}
    if unknown:
        raise Unsupported(
            f"spyre compiler: {name}'s eager code needs {sorted(unknown)}, which the runtime "
            "does not provide"
        )
    digest = hashlib.sha256(code.src.encode()).hexdigest()[:12]
    return f"_spyre_eager_{digest}", code.src, [held[n] for n in inputs]


__all__ = ["GLOBALS", "function_source", "operator", "origin_node"]
