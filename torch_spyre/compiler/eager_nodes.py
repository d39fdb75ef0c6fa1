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
import math
import operator

import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

from torch_spyre.compiler.nodes import _static
from torch_spyre.kernels.search import Unsupported

#: names FX's generated code may use, and the runtime gives it
GLOBALS = ("torch", "device", "inf", "nan", "operator", "NoneType")


def _tracked(buf) -> torch.fx.Node | None:
    node = getattr(buf, "origin_node", None)
    if node is None and isinstance(buf, ir.ComputedBuffer):
        node = getattr(buf.data, "origin_node", None)
    return node


def origin_node(buf) -> torch.fx.Node | None:
    """The FX node whose value is ``buf``: Inductor's best-effort tracking, else
    the one node of the buffer's origins with the buffer's shape that no other
    such origin consumes (a buffer Inductor lowered inside another op's
    lowering, such as the value of a scatter, carries no origin node).  Origins
    that are the value of another buffer are not candidates: Inductor lists
    the consumer of a buffer among its origins too (an attention reading the
    rotated query), and that node computes the other buffer, not this one."""
    node = _tracked(buf)
    scattered = _scatter_origins(buf)
    if node in scattered:
        node = None  # the copy a scatter writes into: its value is the scatter's input
    if node is None:
        size = _sizes_of(buf)
        if size is None:
            return None

        def shaped(o: torch.fx.Node) -> bool:
            # sizes compared as ints (automatic dynamic shapes: a symbolic one
            # is specialised, as the planner specialises every size; an FX
            # value may hold the int where the buffer holds the symbol)
            val = o.meta.get("val")
            return isinstance(val, torch.Tensor) and _same_sizes(val.shape, size)

        # a scatter's mutation of the buffer it writes is that op's value
        mutation = isinstance(buf.get_output_spec(), ir.MutationLayoutSHOULDREMOVE)
        others = set() if mutation else {_tracked(b) for b in V.graph.buffers if b is not buf}
        others |= scattered
        origins = {
            o
            for o in getattr(buf, "origins", ())
            if o.op == "call_function" and shaped(o) and o not in others
        }
        kind = _reduction_kind(buf)
        if kind is not None:
            # a reduction's buffer is the value of a reduction op of its kind,
            # or of none (a sum inside a variance's lowering): never of the
            # pointwise op after it (fuzzer seeds 809942 and 810127: the
            # norm's rsqrt, the iota of a mask, both wrong answers)
            origins = {o for o in origins if _reduces(o, kind)}
        sinks = [o for o in origins if not any(u in origins for u in o.users)]
        # several: the one downstream of all the others (their chains may
        # pass through nodes that are other buffers' values)
        last = [o for o in sinks if set(sinks) - {o} <= _ancestors(o)]
        if (
            len(last) == 1
            and (_one_buffer(last[0]) or _sum_of_mean(buf, last[0]))
            and _reads_covered(buf, last[0])
        ):
            node = last[0]
    return node


#: a reduction buffer's kind -> the ops whose value such a buffer can be
_REDUCTIONS = {
    "sum": ("aten::sum", "aten::mean"),  # a mean's buffer is its sum (``_sum_of_mean``)
    "max": ("aten::amax",),
    "min": ("aten::amin",),
    "prod": ("aten::prod",),
    "any": ("aten::any",),
    "argmax": ("aten::argmax",),
    "argmin": ("aten::argmin",),
}


def _reduction_kind(buf) -> str | None:
    data = getattr(buf, "data", None)
    return data.reduction_type if isinstance(data, ir.Reduction) else None


def _reduces(node: torch.fx.Node, kind: str) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.name in _REDUCTIONS.get(kind, ())


def _reads_covered(buf, node: torch.fx.Node) -> bool:
    """Whether every graph input ``buf``'s loops read is an input of ``node``'s
    computation.  Inductor's loops load only what the value needs, so a guess
    computed without one of them is another op's value (809942: the layer
    norm's sum reads the RMS norm's weight; the RMS norm's rsqrt does not)."""
    try:
        reads = {d.name for d in buf.get_read_writes().reads}
    except (AttributeError, NotImplementedError):
        return False
    inputs = reads & set(V.graph.graph_inputs)
    if not inputs:
        return True
    mine = {n.name for n in _ancestors(node) | {node} if n.op == "placeholder"}
    return inputs <= mine


_SCATTERS = ("aten::index_put", "aten::scatter", "aten::scatter_add", "aten::scatter_reduce",
             "aten::index_add", "aten::index_copy", "aten::select_scatter",
             "aten::slice_scatter")  # fmt: skip


def _scatter_origins(buf) -> set[torch.fx.Node]:
    """The scatter ops of the buffers that write into ``buf``.  Inductor lowers
    a scatter as a copy of its input (``buf``, tracked to the scatter's FX
    node) and a write into that copy: the scatter's value is the write's
    buffer, never the copy (fuzzer seed 700692: the copy taken for the
    scatter's value applied the index_add twice)."""
    out: set[torch.fx.Node] = set()
    if isinstance(buf.get_output_spec(), ir.MutationLayoutSHOULDREMOVE):
        return out
    for b in V.graph.buffers:
        try:
            spec = b.get_output_spec()
        except NotImplementedError:
            continue
        if isinstance(spec, ir.MutationLayoutSHOULDREMOVE) and spec.get_buffer() is buf:
            out |= {o for o in (b.origins or ()) if _mutates(o) or _scatters(o)}
    return out


def _scatters(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.name in _SCATTERS


def _sum_of_mean(buf, node: torch.fx.Node | None) -> bool:
    """Whether ``buf`` is the sum Inductor's lowering of ``node`` (a mean)
    realized, the division by the count left to its consumers."""
    if node is None or node.target not in (torch.ops.aten.mean.dim, torch.ops.aten.mean.default):
        return False
    data = getattr(buf, "data", None)
    return isinstance(data, ir.Reduction) and data.reduction_type == "sum"


#: ops (besides those tagged pointwise) whose Inductor lowering is one buffer
#: holding exactly the op's value: views and copies, gathers and scatters,
#: factories and plain reductions
_ONE_BUFFER = {
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::expand", "aten::permute",
    "aten::clone", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
    "aten::index", "aten::index_put", "aten::index_put_", "aten::scatter", "aten::scatter_",
    "aten::gather", "aten::full", "aten::constant_pad_nd", "aten::cat", "aten::where",
    "aten::sum", "aten::amax", "aten::amin", "aten::prod", "prims::iota",
    "prims::convert_element_type", "spyre::index_put_", "spyre::gather", "spyre::index",
}  # fmt: skip


def _one_buffer(node: torch.fx.Node) -> bool:
    """Whether ``node``'s lowering leaves its value in one buffer.  A guessed
    root must: ``mean`` lowers to a sum (a buffer, the guess's shape and dtype)
    divided in its consumers, so taking that buffer for the mean's value read a
    sum as a mean (MiniMax in the architecture sweep: a silent wrong answer)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target._schema.name in _ONE_BUFFER


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _holds_contiguously(buf, node: torch.fx.Node) -> bool:
    """Whether Inductor's ``buf`` holds ``node``'s value row-major, as a
    contiguous tensor of the node's shape would (so a reshape reads it)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_contiguous():
        return False
    try:
        lay = buf.get_layout()
    except (AttributeError, NotImplementedError):
        return False
    sizes = _static(lay.size, "a held buffer")
    return math.prod(sizes) == val.numel() and lay.is_contiguous()


def _mutated_args(node: torch.fx.Node) -> list[int]:
    """Positions of the arguments a mutating op writes."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write and i < len(node.args)
    ]


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
    # a buffer that is a scatter into another is held under that one's name
    real = getattr(graph.scheduler, "mutation_real_name", {}) if graph.scheduler else {}
    for buf in graph.buffers:
        name = buf.get_name()
        if name not in reads or name in removed:
            continue
        if isinstance(buf, ir.MutationOutput):
            # a read of an in-place op's result is a read of the tensor it
            # wrote: hold that buffer under its FX node, post-mutation
            for target in buf.get_mutation_buffers():
                node = _value_of(origin_node(target), target)
                if node is not None:
                    out[node] = real.get(target.get_name(), target.get_name())
            continue
        node = _value_of(origin_node(buf), buf)
        if node is not None and not _sum_of_mean(buf, node):
            out.setdefault(node, real.get(name, name))
    return out


def _view_base(n: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``n`` is a view of, or None when ``n`` is not a view op."""
    target = n.target
    if n.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view:
        base = n.args[0] if n.args else None
        return base if isinstance(base, torch.fx.Node) else None
    return None


def _storage(n: torch.fx.Node) -> list[torch.fx.Node]:
    """``n`` and the tensors it is a view of, innermost first."""
    chain = [n]
    while (base := _view_base(chain[-1])) is not None:
        chain.append(base)
    return chain


def _check_storage_reads(order, inputs, name: str) -> None:
    """Raise when an ``as_strided`` would read the storage of a held buffer:
    the FX graph addresses the storage its tensor views (``x[1]`` of a
    [2, 5, 16, 16] tensor), and the buffer holding the value holds that value
    only (fuzzer seed 600951: out of bounds).  Graph inputs are the tensors
    themselves, storage and all."""
    buffers = {n for n in inputs if n.op != "placeholder"}
    for n in order:
        if n.target is not _aten.as_strided.default:
            continue
        if any(c in buffers for c in _storage(n.args[0])):
            raise Unsupported(
                f"spyre compiler: {name} reads the storage under {n.args[0].name} "
                "(as_strided), which the buffer holding it does not keep"
            )


def _writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[int]]:
    """Storage root -> graph positions of the in-place ops writing it."""
    out: dict[torch.fx.Node, list[int]] = {}
    for pos, n in enumerate(graph.nodes):
        if n.op == "call_function" and _mutates(n):
            for i in _mutated_args(n):
                a = n.args[i]
                if isinstance(a, torch.fx.Node):
                    out.setdefault(_storage(a)[-1], []).append(pos)
    return out


def _check_no_stale_read(order, held, name: str, root=None) -> None:
    """Raise when re-running ``order`` could read a tensor in another state
    than the FX graph's node did.  The FX graph names a tensor an in-place op
    wrote by its node from before the write, so:

    * a node after the write re-run from the tensor's producers computes the
      old value (unless a buffer holding the written value is an input);
    * a node before the write reading a held tensor (a graph input, a
      buffer) reads the new value if the wrapper ran the write first, which
      it may: the write does not wait for a reader it does not know of (a
      Mamba layer's conv state, rewritten before its old value's readers ran
      as eager kernels: Falcon-H1's decode, a silent wrong answer).

    Both then run on the host from the IR instead, whose reads Inductor
    orders.  The write of ``root`` itself, the in-place op this function
    computes (on a copy), is not one of those."""
    graph = order[0].graph if order else None
    if graph is None:
        return
    writes = _writes(graph)
    if not writes:
        return
    position = {n: i for i, n in enumerate(graph.nodes)}
    for n in order:
        for a in n.all_input_nodes:
            chain = _storage(a)
            at = [p for p in writes.get(chain[-1], ()) if root is None or p != position[root]]
            if not at:
                continue
            is_held = any(c in held for c in chain)
            if any(p < position[n] for p in at) and not is_held:
                raise Unsupported(
                    f"spyre compiler: {name} reads {a.name} after an in-place op wrote it, "
                    "and no buffer holding the written value is an input"
                )
            if any(p > position[n] for p in at) and is_held:
                raise Unsupported(
                    f"spyre compiler: {name} reads {a.name} before an in-place op writes "
                    "it, which the wrapper may run first"
                )


def _matches(val, buf) -> bool:
    if not isinstance(val, torch.Tensor):
        return False
    size = _sizes_of(buf)
    return size is not None and _same_sizes(val.shape, size) and val.dtype == buf.get_dtype()


def _sizes_of(buf) -> list[int] | None:
    """``buf``'s sizes as ints (specialised), or None: a buffer with no
    layout of its own (a mutation's marker), or a data-dependent size."""
    try:
        return _static(buf.get_size(), buf.get_name())
    except Exception:  # noqa: BLE001 - NotImplementedError, GuardOnDataDependentSymNode
        return None


def _same_sizes(fx_shape, size: list[int]) -> bool:
    """An FX value's shape against a buffer's sizes (ints): compared as ints,
    as under dynamic shapes a specialised FX size prints as its value (130)
    where the buffer's prints as its symbol (s18).  A data-dependent size
    (an unbacked symbol, which no guard may specialise) matches nothing."""
    try:
        return _static(fx_shape, "an FX value") == size
    except Exception:  # noqa: BLE001 - GuardOnDataDependentSymNode and the like
        return False


def _value_of(node: torch.fx.Node | None, buf) -> torch.fx.Node | None:
    """The FX node whose tensor ``buf`` holds: ``node`` itself, or for an op
    with several outputs (``max.dim``: values and indices, each its own
    buffer) the one ``getitem`` of it with the buffer's shape and dtype.  None
    when that is not certain: the node is then recomputed, never misread."""
    if node is None:
        return None
    val = node.meta.get("val")
    if isinstance(val, list | tuple):
        picks = [
            u
            for u in node.users
            if u.op == "call_function"
            and u.target is operator.getitem
            and _matches(u.meta.get("val"), buf)
        ]
        return picks[0] if len(picks) == 1 else None
    return node if _matches(val, buf) else None


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


_aten = torch.ops.aten
#: views re-run as reshapes in eager code (``function_source``)
_VIEWS = (_aten.view.default, _aten._unsafe_view.default)
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
            n *= _static([shape[d]], "a reduction")[0]
        out = call(_aten.add.Tensor, (call(_aten.mul.Tensor, (mean, 0.0)), float(n)))
    return call(_aten.reshape.default, (out, _static(size, "a reduction")))


#: the largest graph constant an eager node writes into its code
INLINE_CONSTANT_ELEMENTS = 64


def _inline_constant(n: torch.fx.Node) -> torch.Tensor | None:
    """The value of a small graph constant (a pad's fill, a lane table
    Inductor inlined instead of holding it as a buffer), or None."""
    value = getattr(V.graph.module, str(n.target), None)
    if isinstance(value, torch.Tensor) and value.numel() <= INLINE_CONSTANT_ELEMENTS:
        return value
    return None


def function_source(snode) -> tuple[str, str, list[str]]:
    """(name, Python source of a function computing ``snode``'s buffer with
    eager ops, the wrapper variables to call it with).  Unsupported when the
    buffer's FX nodes cannot be found or re-run (a mutation, an input the
    wrapper does not hold)."""
    buf = snode.node
    name = buf.get_name()
    # a welford reduction's buffer (a mean, an M2, a count) is computed from the
    # reduction's op whatever Inductor tracked it to: the M2 of a layer norm
    # after an RMS norm was tracked to the RMS norm's rsqrt (fuzzer seed
    # 805763, a wrong answer)
    welford = _welford(buf)
    if welford is None and isinstance(getattr(buf, "data", None), ir.WelfordReduction):
        raise Unsupported(f"spyre compiler: {name}: a welford reduction of no single op")
    root = origin_node(buf) if welford is None else None
    if welford is not None:
        root = welford[0].args[0]  # the reduction's input: computed eagerly, then reduced
        if not isinstance(root, torch.fx.Node):
            raise Unsupported(f"spyre compiler: {name}: a welford reduction of a constant")
    if root is None or root.op not in ("call_function", "placeholder", "get_attr"):
        raise Unsupported(f"spyre compiler: {name} has no FX node to run eagerly")
    reads = {d.name for d in snode.read_writes.reads}
    held = _realized(reads)
    layout = buf.get_output_spec()
    if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
        target = layout.get_buffer()
        if math.prod(_static(target.get_size(), target.get_name())) != math.prod(
            _static(buf.get_size(), name)
        ):
            # a copy into part of another buffer (a view an in-place op wrote):
            # the FX value is the part, the store is through the view
            raise Unsupported(
                f"spyre compiler: {name} writes part of {target.get_name()}, through a view"
            )
    through_view = None  # the tensor an in-place op writes through a view of
    if isinstance(layout, ir.MutationLayoutSHOULDREMOVE) and root.args:
        # a scatter writes into a copy of its input that Inductor made first:
        # until it runs, that buffer holds the input
        target = layout.get_buffer()
        chain = _storage(root.args[0]) if isinstance(root.args[0], torch.fx.Node) else [None]
        # the tensor the buffer holds: the first of the chain the wrapper
        # holds already (a view of the matmul's output), else its base
        base = next((c for c in chain if c in held), chain[-1])
        if base is None:
            base = root.args[0]
        elif base is not root.args[0]:
            # it writes through a view (index_add into permute(pad(x)), whose
            # buffer is the pad's): the buffer holds the base, which the code
            # copies, views again and writes through; its value is the base
            if not _holds_contiguously(target, base):
                raise Unsupported(
                    f"spyre compiler: {name} writes {target.get_name()} through a view "
                    "of a tensor the buffer holds in another layout"
                )
            through_view = base
        held[base] = target.get_name()
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
        if n.op == "get_attr" and _inline_constant(n) is not None:
            order.append(n)  # a small constant Inductor inlined: written into the code
            return
        if n.op != "call_function":
            raise Unsupported(
                f"spyre compiler: {name} needs {n.name} ({n.op}), which the wrapper does not hold"
            )
        if _mutates(n) and (n is not root or len(_mutated_args(n)) != 1):
            raise Unsupported(f"spyre compiler: {name} comes from a mutation ({n.target})")
        for a in n.all_input_nodes:
            visit(a)
        order.append(n)

    if welford is not None and root in held:
        seen.add(root)
        inputs.append(root)
    else:
        visit(root)
    _check_no_stale_read(order, held, name, root if _mutates(root) else None)
    _check_storage_reads(order, inputs, name)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in{i}")
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and n.op == "call_function":
            # a held buffer may be laid out in another shape of the same
            # elements (a matmul's [512, 8] output the FX graph views as
            # [16, 32, 8]): read it in the FX node's shape
            shape = _static(val.shape, n.name)
            env[n] = g.call_function(_aten.reshape.default, (env[n], shape))
    if through_view is not None:
        env[through_view] = g.call_function(torch.ops.aten.clone.default, (env[through_view],))
    result = None
    for n in order:
        if n is root and _mutates(n) and through_view is not None:
            env[n] = g.node_copy(n, lambda a: env[a])  # in place, through the views
            result = env[through_view]
        elif n is root and _mutates(n):
            # the buffer is the functional value of the mutation: the op writes
            # a copy of its target (the graph's own tensor stays as it is)
            (i,) = _mutated_args(n)
            target = g.call_function(torch.ops.aten.clone.default, (env[n.args[i]],))
            written = n.args[i]
            env[n] = g.node_copy(n, lambda a, t=target, w=written: t if a is w else env[a])
            result = target
        elif n is root and _sum_of_mean(buf, n):
            # the buffer is the mean's sum, in the buffer's dtype (fp32 for a
            # 16-bit mean): the count divides in the consumers
            x, dims = env[n.args[0]], (n.args[1] if len(n.args) > 1 else None)
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            env[n] = g.call_function(
                torch.ops.aten.sum.dim_IntList, (x, dims, keep), {"dtype": buf.get_dtype()}
            )
        elif n.op == "get_attr":
            value = _inline_constant(n)
            env[n] = g.call_function(
                torch.tensor,
                (value.tolist(),),
                {"dtype": value.dtype, "device": torch.device(value.device.type)},
            )
        elif n.target in _VIEWS:
            # the value, whatever the strides of the buffer it is computed from:
            # the FX graph's view was valid for its tensor's meta strides, and
            # a held buffer has the layout Inductor chose for it
            env[n] = g.call_function(_aten.reshape.default, (env[n.args[0]], n.args[1]))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    result = env[root] if result is None else result
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
