"""The Inductor scheduling and wrapper codegen for the ``spyre`` device.

``SpyreScheduling`` decides fusion (pointwise chains; reductions with their
producers and consumers) and turns each fused group into one kernel program
(``lowering.ProgramBuilder``).  ``SpyreWrapperCodegen`` is Inductor's Python
wrapper with our runtime imported; each kernel is defined in the wrapper as
the JSON of its program and launched with the graph's tensors.  Matmuls
(``mm``/``addmm``/``bmm``) are Inductor extern kernels: they call the eager
spyre kernels (PE-array programs with their bias epilogue) on device memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from textwrap import dedent

import sympy
from torch._inductor import ir
from torch._inductor.codegen.common import BackendFeature, DeviceOpOverrides
from torch._inductor.codegen.wrapper import FreeLine, PythonWrapperCodegen, WrapperLine
from torch._inductor.scheduler import BaseSchedulerNode, BaseScheduling
from torch._inductor.utils import sympy_product
from torch._inductor.virtualized import V
from torch.utils._ordered_set import OrderedSet

from torch_spyre import settings
from torch_spyre.compiler import (
    checked_passes,
    degrade,
    eager_nodes,
    graph_state,
    host_nodes,
    layouts,
    lowering,
)
from torch_spyre.compiler.matmuls import MATMULS, has_bias, matmul_steps, prologues, weight_prologue
from torch_spyre.compiler.nodes import (  # noqa: F401  (_static: compiler.layouts, tests)
    _buffer_info,
    _simplify,
    _static,
    _storage_name,
    run_nodes,
)
from torch_spyre.ir import constants
from torch_spyre.kernels import options
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.runtime import cards

log = logging.getLogger("torch_spyre.compiler")

#: every plan made in this process, newest last (for tests and debugging)
PLANS: list[lowering.Plan] = []


def _remember(plan: lowering.Plan) -> None:
    PLANS.append(plan)
    if len(PLANS) > 256:
        del PLANS[:128]


def _planning_config():
    """The card's config as the planner sees it (``options.planning(cores=...)``)."""
    return options.planning_config(cards.config(0))


def debug_enabled() -> bool:
    return settings.get().debug


def _numel(size) -> str:
    """The element count of ``size``, as text (sizes may be symbolic)."""
    return str(sympy.Mul(*[sympy.sympify(x) for x in size]))


def _refuse_partial_writes(nodes) -> None:
    """A node writing part of another buffer (the copy back into a view an
    in-place op wrote through a realized copy) is not planned: fused with a
    reader of that buffer, the group forwarded the view's old value (the
    fuzzer's seed 201001, a wrong answer).  It runs on the host from its IR,
    whose store index says where the part goes."""
    for n in nodes:
        for buf in n.get_outputs():
            layout = buf.node.get_output_spec()
            if not isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
                continue
            target = layout.get_buffer()
            if _numel(target.get_size()) != _numel(buf.node.get_size()):
                raise lowering.Unsupported(
                    f"a store of {buf.get_name()} {list(buf.node.get_size())} into part of "
                    f"{target.get_name()} {list(target.get_size())}"
                )


def _check_bound_shapes(plan: lowering.Plan) -> None:
    """Every operand is bound to a wrapper tensor of the shape it was planned
    for: a node writing part of another buffer (a copy back into a view, after
    an in-place op on a realized view) is stored through that buffer, which
    this planner does not express, so it degrades instead of failing on the
    card."""
    for u in plan.operands:
        if u.role != "output" or not u.shape:
            continue
        storage = _storage_name(u.buffer)
        if storage == u.buffer:
            continue
        size = tuple(_static(V.graph.get_buffer(storage).get_size(), storage))
        if size != tuple(u.shape):
            raise lowering.Unsupported(
                f"a store of {u.buffer} {list(u.shape)} into part of {storage} {list(size)}"
            )


class SpyreScheduling(BaseScheduling):
    @classmethod
    def get_backend_features(cls, device) -> OrderedSet[BackendFeature]:
        # A reduction is never split in two kernels (Inductor's split reductions
        # for few long rows, as for the C++ backend): the planner splits rows
        # over cores and streams rows longer than the LX itself, and the first
        # kernel of a split reads the rows through a view no program expresses
        # (found by the fuzzer: mean over three dims of a transposed input)
        return OrderedSet([BackendFeature.REDUCE_TO_SINGLE_ELEMENT])

    def group_fn(self, sizes):
        return tuple(V.graph.sizevars.simplify(sympy_product(s)) for s in sizes)

    # ------------------------------------------------------------- fusion
    @staticmethod
    def _plain(node: BaseSchedulerNode) -> bool:
        return not (node.is_extern() or node.is_template() or node.is_foreach()) and all(
            isinstance(n.node, ir.ComputedBuffer) for n in node.get_nodes()
        )

    @staticmethod
    def _total(node: BaseSchedulerNode) -> sympy.Expr:
        numel, rnumel = node.group[1]
        return numel * rnumel

    def can_fuse_vertical(self, node1, node2) -> bool:
        if not options.current().fuse:  # a baseline: one kernel per node
            return False
        if not (self._plain(node1) and self._plain(node2)):
            return False
        # a consumer over the same elements, or over the rows a reduction made
        t1, t2 = self._total(node1), self._total(node2)
        n1 = node1.group[1][0]
        return bool(t1 == t2 or t2 == n1 or node2.group[1][0] == n1)

    def can_fuse_horizontal(self, node1, node2) -> bool:
        if not options.current().fuse:
            return False
        if not (self._plain(node1) and self._plain(node2)):
            return False
        if node1.group[1] != node2.group[1]:
            return False
        # siblings that read a common buffer (e.g. the three outputs of a welford)
        r1 = {d.name for d in node1.read_writes.reads}
        r2 = {d.name for d in node2.read_writes.reads}
        return bool(r1 & r2)

    # ------------------------------------------------------------ codegen
    def codegen_node(self, node) -> None:
        nodes = list(node.get_nodes())
        if self._defer_weight_prologue(nodes):
            return
        plans = None
        mm = self._absorbable_matmul(nodes)
        if mm is not None:
            try:
                fused = self._plan(nodes, mm, commit=False)
                apart = self._plan(nodes)
            except lowering.Unsupported as e:
                log.info("spyre: matmul epilogue not fused: %s", e)
            else:
                # fuse when the cost model says so (an epilogue that reduces
                # over n keeps n whole per core, which can cost more than it saves)
                cfg_card = cards.card(0)
                t_fused = cfg_card.estimate(fused.program).time_s
                t_apart = (
                    cfg_card.estimate(mm.plan.program).time_s
                    + cfg_card.estimate(apart.program).time_s
                    + sum(cfg_card.estimate(p.program).time_s for p in apart.pre)
                )
                if t_fused <= t_apart:
                    plans = [self._plan(nodes, mm)]
                else:
                    log.info(
                        "spyre: %s epilogue not fused (%.1f us fused vs %.1f us apart)",
                        mm.node.get_name(),
                        t_fused * 1e6,
                        t_apart * 1e6,
                    )
                    plans = [apart]
        # a group that does not plan is split, then run as eager kernels (degrade.py)
        state = graph_state.of(V.graph.wrapper_code)
        plans = plans or degrade.plan_group(nodes, self._plan, state)
        for p in plans:
            if isinstance(p, lowering.Plan):
                V.graph.removed_buffers |= p.removed
        for n in nodes:
            n.mark_run()
        for p in plans:
            if isinstance(p, degrade.EagerNode):
                self._emit_eager(p)
            else:
                self._emit(p)
        self.free_buffers_in_scheduler()

    def _defer_weight_prologue(self, nodes) -> bool:
        """A group that only dequantises the weight of a later matmul (8-bit
        data times its scale) is planned into that matmul: its loads and vector
        steps run in the matmul's k loop, and the 16-bit weight never reaches
        device memory (``matmuls.weight_prologue``).  Chosen by the cost model:
        the matmul with its prologue against the two kernels apart."""
        opts = options.current()
        if not opts.fuse or opts.naive:
            return False
        found = weight_prologue(nodes, self.scheduler)
        if found is None:
            return False
        pro, mm_node = found
        table = prologues()
        card = cards.card(0)
        try:
            table[pro.weight] = pro
            fused, _ = plan_extern_matmul(mm_node.node)
            del table[pro.weight]
            plain, _ = plan_extern_matmul(mm_node.node)
            alone = self._plan(nodes)
        except lowering.Unsupported as e:
            table.pop(pro.weight, None)
            log.info("spyre: %s not planned into its matmul: %s", pro.weight, e)
            return False
        t_fused = card.estimate(fused.program).time_s
        t_apart = (
            card.estimate(plain.program).time_s
            + card.estimate(alone.program).time_s
            + sum(card.estimate(p.program).time_s for p in alone.pre)
        )
        if t_fused > t_apart:
            log.info(
                "spyre: %s not planned into its matmul (%.1f us fused vs %.1f us apart)",
                pro.weight,
                t_fused * 1e6,
                t_apart * 1e6,
            )
            return False
        table[pro.weight] = pro
        V.graph.removed_buffers.add(pro.weight)  # never allocated nor stored
        # Inductor frees a graph input after its last reader, and the group's
        # reads now happen when the matmul runs: they move to the matmul's last
        # use (scheduler attributes read by Inductor's own free_buffers; covered
        # by tests/compiler/test_quantized_compile.py)
        to_free = self.scheduler.buffer_names_to_free
        for r in pro.reads:
            if r in to_free:
                to_free.discard(r)
                mm_node.last_usage.add(r)
        for n in nodes:
            n.mark_run()
        self.free_buffers_in_scheduler()
        return True

    def _absorbable_matmul(self, nodes):
        """The pending matmul whose output only this group reads, if it was the
        last kernel emitted: its epilogue (bias, activation, residual) is fused."""
        wrapper = V.graph.wrapper_code
        pending = graph_state.of(wrapper).pending
        if not pending or not options.current().fuse:
            return None
        group = {n.get_name() for n in nodes}
        reads = {d.name for n in nodes for d in n.read_writes.reads}
        for name, mm in list(pending.items()):
            if name not in reads or mm.absorbed:
                continue
            if any(_is_kernel_line(x) for x in wrapper.lines[mm.position + 1 :]):
                continue
            buf = self.scheduler.name_to_buf.get(name)
            if buf is None:
                continue
            # every reader is in this group (a graph output is stored as well)
            if all(
                type(u.node).__name__ == "OutputNode"
                or (isinstance(u.node, BaseSchedulerNode) and u.node.get_name() in group)
                for u in buf.users
            ):
                return mm
        return None

    def _plan(self, nodes, mm=None, commit: bool = True) -> lowering.Plan:
        if mm is None:
            return self._build(nodes)
        try:
            return self._build(nodes, mm, commit)
        except lowering.ReadShape as e:
            # the epilogue reads the matmul's output in finer pieces (its rows
            # as batch x tokens x heads): the matmul is planned in them, now
            # and when the fused plan is made again (codegen_node)
            if e.buffer != mm.node.get_name() or mm.out_pieces is not None:
                raise
            mm.out_pieces = e.pieces
            return self._build(nodes, mm, commit)

    def _build(self, nodes, mm=None, commit: bool = True) -> lowering.Plan:
        b = lowering.ProgramBuilder(
            _buffer_info, _planning_config(), _simplify, options.current().naive
        )
        if mm is not None:
            matmul_steps(b, mm.node, mm.out_pieces)
        group = {n.get_name() for n in nodes}
        # the layout of a stored intermediate, costed with its readers
        b.readers_cost = functools.partial(layouts.consumers_cost, self, group, b.cfg)
        keep = set()
        graph_outs = set(V.graph.get_output_names())
        for n in nodes:
            for buf in n.get_outputs():
                name = buf.get_name()
                users = [u for u in buf.users if u.node is not None]
                outside = [
                    u
                    for u in buf.users
                    if not isinstance(u.node, BaseSchedulerNode) or u.node.get_name() not in group
                ]
                if outside or name in graph_outs or not users:
                    keep.add(name)
        _refuse_partial_writes(nodes)
        run_nodes(b, nodes)
        kname = "_".join(n.get_name() for n in nodes)
        if mm is not None:
            kname = mm.node.get_name() + "_" + kname
        origin = sorted(
            {
                str(o.target).split(".")[-2] if "." in str(o.target) else str(o.target)
                for n in nodes
                for o in (n.node.origins or ())
                if o.op == "call_function"
            }
        )
        label = "fused_" + "_".join(origin[:4]) if origin else "fused"
        if mm is not None:
            label = "fused_mm_" + "_".join(origin[:3])
            if mm.node.get_name() in graph_outs:
                keep.add(mm.node.get_name())
        plan = b.finish(f"{label}_{kname}", keep, allow_lx=True)
        _check_bound_shapes(plan)
        if mm is not None and commit:
            mm.absorbed = True
            for u in plan.operands:
                if u.buffer in mm.inputs:
                    u.buffer = f"{mm.var}[{mm.inputs.index(u.buffer)}]"
            plan.after = f"del {mm.var}"
        return plan

    def _emit_eager(self, eager: degrade.EagerNode) -> None:
        """A node no kernel program expresses, run as eager ops in the graph."""
        wrapper = V.graph.wrapper_code
        snode = eager.node
        name = snode.node.get_name()  # the buffer (the scheduler node is opN)
        try:
            fname, src, args = eager_nodes.function_source(snode)
        except lowering.Unsupported as err:
            self._emit_host(eager, err)
            return
        # The eager code may read a graph input the node does not read itself
        # (a welford reduction's buffer holds M2, not the variance: the eager
        # code recomputes the variance from the input).  Inductor freed that
        # input after its last declared reader: keep it alive instead (its
        # `del` line is dropped; the caller holds the input anyway).
        inputs = {a for a in args if a in V.graph.graph_inputs}
        if inputs:
            wrapper.lines[:] = [
                ln
                for ln in wrapper.lines
                if not (isinstance(ln, FreeLine) and ln.node.get_name() in inputs)
            ]
        defined = graph_state.of(wrapper).defined
        if fname not in defined:
            defined.add(fname)
            wrapper.header.writeline(f"{fname} = spyre_rt.eager_function({src!r})")
        out = name
        layout = snode.node.get_output_spec()
        if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
            # a scatter into another buffer: the wrapper holds only that one,
            # and the function computes its whole new value
            out = layout.get_buffer().get_name()
        elif name in V.graph.removed_buffers or isinstance(layout, ir.NoneLayout):
            out = "None"  # a node run for its effect (an assert): never allocated
        call = ", ".join([fname, repr(name), out, *args])
        wrapper.writeline(f"spyre_rt.run_eager({call})  # not planned: {eager.reason[:100]}")

    def _emit_host(self, eager: degrade.EagerNode, eager_err: Exception) -> None:
        """The last step: the node computed on the host from its IR
        (``host_nodes.py``), counted as a host fallback."""
        wrapper = V.graph.wrapper_code
        snode = eager.node
        name = snode.node.get_name()
        what = f"cannot plan {name} (from {degrade._origins(snode)}) as a kernel program"
        try:
            fname, src, args = host_nodes.function_source(snode)
        except lowering.Unsupported as err:
            raise lowering.Unsupported(
                f"spyre compiler: {what} ({eager.reason}), nor run it as eager kernels "
                f"({eager_err}) nor on the host ({err}). Run this op outside the compiled "
                "region, or file an issue with this message."
            ) from None
        degrade.step(
            "host",
            f"{name} (from {degrade._origins(snode)}) runs on the host",
            str(eager_err),
            graph_state.of(wrapper),
        )
        defined = graph_state.of(wrapper).defined
        if fname not in defined:
            defined.add(fname)
            wrapper.header.writeline(f"{fname} = spyre_rt.host_function({src!r})")
        out = name
        layout = snode.node.get_output_spec()
        if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
            out = layout.get_buffer().get_name()  # a write into part of another buffer
        call = ", ".join([fname, repr(name), out, *args])
        wrapper.writeline(f"spyre_rt.run_host({call})  # not planned: {eager.reason[:100]}")

    def _emit(self, plan: lowering.Plan) -> str:
        return emit_plan(plan)

    def codegen_sync(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def ready_to_flush(self) -> bool:
        return False

    def codegen_template(self, template_node, epilogue_nodes, prologue_nodes):
        raise lowering.Unsupported("spyre has no Inductor templates yet")

    def benchmark_fused_nodes(self, nodes):
        raise NotImplementedError


def emit_restickify(plan: lowering.Plan) -> None:
    """The restickify copies ``plan`` reads (``compiler.layouts``), each into
    a fresh buffer that later kernels reading that layout reuse."""
    wrapper = V.graph.wrapper_code
    for pre in plan.pre:
        src, dst = pre.operands[0], pre.operands[1]
        wrapper.writeline(
            f"{dst.buffer} = torch.empty(({dst.layout.device_numel},), "
            f"dtype={dst.layout.dtype}, device={_storage_name(src.buffer)}.device)"
        )
        emit_plan(pre)
        graph_state.of(wrapper).relaid[(src.buffer, dst.layout)] = dst.buffer


def emit_plan(plan: lowering.Plan) -> str:
    """Write ``plan``'s kernel launch (after the restickify copies it reads) into the wrapper."""
    wrapper = V.graph.wrapper_code
    emit_restickify(plan)
    _remember(plan)
    state = graph_state.of(wrapper)
    reads, stored = state.reads, state.layouts
    for u in plan.operands:  # for compiler.layouts: readers still to come
        if not plan.program.name.startswith("restickify_"):
            reads[u.buffer] = reads.get(u.buffer, 0) + (u.role == "input")
        # an output stored whole in another stick dim (layouts.choose_output;
        # a store through a view has the host dims of the view)
        if u.role == "output" and u.shape and tuple(u.layout.host_size) == tuple(u.shape):
            if u.layout != SpyreTensorLayout.default(u.shape, u.layout.dtype):
                stored[u.buffer] = u.layout  # its readers read it so
    kname = _define(wrapper, plan)
    args = ", ".join(
        _storage_name(u.buffer) for u in plan.operands if u.role not in constants.CONST_ROLES
    )
    wrapper.writeline(f"{kname}.run({args})  # {plan.program.name}")
    if plan.after:
        wrapper.writeline(plan.after)
    return kname


def plan_extern_matmul(node) -> tuple[lowering.Plan, list[str]]:
    """The program of an extern matmul node alone (with its weight's prologue,
    if any) and the buffers it reads."""
    b = lowering.ProgramBuilder(
        _buffer_info, _planning_config(), _simplify, options.current().naive
    )
    names = matmul_steps(b, node)
    plan = b.finish(
        f"{node.python_kernel_name.split('.')[-1]}_{node.get_name()}",
        {node.get_name()},
        allow_lx=True,
    )
    return plan, names


def _define(wrapper, plan: lowering.Plan) -> str:
    """Define the kernel in the wrapper module (once per program); its name."""
    text = plan.program.to_json()
    bindings = [
        [u.name, u.role, list(u.shape), u.start, u.layout.device_numel] for u in plan.operands
    ]
    body = f"spyre_rt.kernel_from_json({text!r}, {json.dumps(bindings)})"
    kname = "spyre_" + hashlib.sha256(body.encode()).hexdigest()[:12]
    defined = graph_state.of(wrapper).defined
    if kname not in defined:
        defined.add(kname)
        wrapper.header.writeline(f"{kname} = {body}")
        if debug_enabled():
            usage = plan.program.lx_usage(cards.config(0))
            print(f"[spyre] {kname}: {plan.program.name}, LX {sum(usage.values())} B per core")
            print(plan.program.dump())
    return kname


_QUIET_LINES = {
    "FreeLine",
    "FreeIfNotReusedLine",
    "ReuseLine",
    "AllocateLine",
    "NullLine",
    "LineContext",
    "AssertSizeStrideLine",
    "CommentLine",
    "EnterDeviceContextManagerLine",
    "ExitDeviceContextManagerLine",
}


def _is_kernel_line(line) -> bool:
    """A wrapper line that runs something (not an allocation, free, comment or
    check).  Checks are matched by name, not by a list of releases: torch 2.14
    added ``GroupedAssertSizeStrideLine`` (one ``assert_size_stride_grouped``
    call for several buffers), and any ``*Assert*Line`` runs no kernel."""
    name = type(line).__name__
    if name in _QUIET_LINES or ("Assert" in name and name.endswith("Line")):
        return False
    if isinstance(line, str):
        s = line.strip()
        return bool(s) and not s.startswith(("#", "del ", "assert"))
    return True


class _PendingMatmul:
    def __init__(self, node, var, inputs, position, line):
        self.node, self.var, self.inputs, self.position = node, var, inputs, position
        self.line = line
        self.absorbed = False
        #: the pieces its fused epilogue reads its output in (``lowering.ReadShape``)
        self.out_pieces: list[list[int]] | None = None


class _MatmulLine(WrapperLine):
    """The launch of a standalone matmul kernel, dropped when a consumer fused it."""

    def __init__(self, pending: _PendingMatmul, call: str):
        self.pending, self.call = pending, call

    def codegen(self, code) -> None:
        if not self.pending.absorbed:
            code.writeline(self.call)
            code.writeline(f"del {self.pending.var}")


class SpyreWrapperCodegen(PythonWrapperCodegen):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: the backend's state for this graph (``compiler/graph_state.py``)
        self.spyre = graph_state.GraphState()

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            from torch._inductor.codegen.wrapper import SubgraphPythonWrapperCodegen

            return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper, partition_signatures)
        return SpyreWrapperCodegen()

    def codegen_free(self, buffer) -> None:
        # A node the planner cannot express is recomputed from its FX nodes
        # (compiler/eager_nodes.py), which may reach a graph input that
        # Inductor's read sets had already used up and freed.  Graph inputs
        # stay alive for the whole call (the caller holds most of them: the
        # weights, the cache, the token ids); every other buffer is freed as
        # Inductor plans.  Overriding this wrapper method is the public hook:
        # the wrapper class is ours (register_backend_for_device).
        if isinstance(buffer, ir.InputBuffer) and buffer.get_name() in V.graph.graph_inputs:
            return
        super().codegen_free(buffer)

    def generate_extern_kernel_out(self, node) -> None:
        if getattr(node, "python_kernel_name", None) in MATMULS:
            try:
                plan, names = plan_extern_matmul(node)
            except lowering.Unsupported as e:
                w = node.inputs[2 if has_bias(node.python_kernel_name) else 1]
                if w.get_name() in prologues():  # its weight was never stored: no way back
                    raise lowering.Unsupported(
                        f"spyre compiler: cannot plan {node.get_name()} with its weight's "
                        f"dequantisation: {e}"
                    ) from None
                # the eager matmul kernel (functional overload: PE-array program),
                # then a device copy into Inductor's output buffer
                degrade.step(
                    "eager_extern",
                    f"matmul {node.get_name()} runs as its eager kernel",
                    degrade._reason(e),
                    self.spyre,
                )
                node.codegen_comment(self)
                op = node.python_kernel_name.split(".")[-1]
                args = [*node.codegen_args(), *node.codegen_kwargs(skip_out=True)]
                self.writeline(
                    f"spyre_rt.out_via_eager(torch.ops.aten.{op}.default, "
                    f"{node.codegen_reference()}, {', '.join(args)})"
                )
                return
            else:
                emit_restickify(plan)  # the copies in another layout the matmul reads
                _remember(plan)
                node.codegen_comment(self)
                var = f"_spyre_mm_{node.get_name()}"
                self.writeline(f"{var} = ({', '.join(names)},)")
                kname = _define(self, plan)
                args = ", ".join(
                    f"{var}[{names.index(u.buffer)}]" if u.buffer in names else u.buffer
                    for u in plan.operands
                    if u.role not in constants.CONST_ROLES
                )
                pending = _PendingMatmul(node, var, names, len(self.lines), None)
                pending.plan = plan
                line = _MatmulLine(pending, f"{kname}.run({args})  # {plan.program.name}")
                pending.line = line
                self.writeline(line)
                self.spyre.pending[node.get_name()] = pending
                return
        super().generate_extern_kernel_out(node)

    def codegen_inputs(self) -> None:
        super().codegen_inputs()
        names = tuple(
            n
            for n, t in V.graph.constants.items()
            if getattr(t, "device", None) is not None and t.device.type == "spyre"
        )
        if names:
            # constants loaded from the FX-graph cache are laid out as part of
            # loading, not billed to the first call (runtime/compiled.load_constants)
            self.prefix.writeline(f"spyre_rt.load_constants(globals(), {names!r})")

    def write_header(self) -> None:
        super().write_header()
        self.header.writeline("from torch_spyre.runtime import compiled as spyre_rt")
        # graph sub-passes dropped before lowering (checked_passes.py)
        module = getattr(getattr(V, "graph", None), "module", None)
        for what, reason in getattr(module, "meta", {}).get(checked_passes.DROPPED, ()):
            degrade.note(self, "pass", what, reason)

    def memory_plan_reuse(self) -> None:
        """Inductor's buffer reuse, keyed also by shape and strides on spyre.

        A device buffer is stored in the stick layout of the shape it was
        allocated with (docs/hardware.md, "Layout rule"); Inductor reuses a
        freed buffer of the same byte size for any shape
        (``reinterpret_tensor``), and a kernel reading or writing that view in
        another shape's layout needs a whole re-layout copy (a d2d pass per
        use, ``runtime/compiled.py``).  Reusing only same-shape buffers keeps
        every kernel operand whole and in its own layout."""
        from torch._inductor.codegen import wrapper

        base = wrapper.buffer_reuse_key

        def key(node):
            k = base(node)
            dev = node.get_device()
            if dev is None or dev.type != "spyre":
                return k
            sizes = tuple(V.graph.sizevars.simplify(s) for s in node.get_size())
            strides = tuple(V.graph.sizevars.simplify(s) for s in node.get_stride())
            return (*k, str(sizes), str(strides))

        wrapper.buffer_reuse_key = key
        try:
            super().memory_plan_reuse()
        finally:
            wrapper.buffer_reuse_key = base


class SpyreDeviceOpOverrides(DeviceOpOverrides):
    def import_get_raw_stream_as(self, name: str) -> str:
        return dedent(
            f"""
            def {name}(_):
                return 0
            """
        )

    def set_device(self, device_idx: int) -> str:
        return f"torch.spyre.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.spyre.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.spyre.device({device_idx})"

    def current_stream(self) -> str:
        return "torch.spyre.current_stream()"

    def cpp_kernel_type(self) -> str:
        return "void*"
