"""Layout choice by cost: the stick dim of stored buffers and of kernel
operands, and explicit re-layout (restickify) kernel programs.

A buffer in device memory has one stick layout (``SpyreTensorLayout``): by
default the last host dim is the stick dim.  A kernel that reads a buffer
transposed, or one whose last dim is narrower than a stick (a head dim of
16 fp16 elements fills a quarter of each 128-byte stick), can move fewer
bytes when the buffer's stick dim is another dim.  Graph inputs and outputs
keep the default layout (they are user tensors).  Two decisions, both by
the timing model:

* **producer** (``choose_output``): a computed intermediate that only row
  kernels read whole (no view) is stored in the candidate layout that
  minimises the producer's modelled time plus its readers' (each reading
  fused group planned with the buffer in that layout: ``consumers_cost``);
  the readers then read it so (``layout_of``), and no data is re-laid;
* **reader** (``choose``): an input operand of a row kernel that reads its
  whole buffer in the default layout (a graph input, or an intermediate
  whose producer kept the default, e.g. a matmul) is read from a
  restickified copy when the kernel re-planned with the operand in a
  candidate layout, plus the **restickify** program (``restickify_plan``:
  stick loads through the source layout, stick stores through the target
  layout, planned and timed like any row kernel) shared by the kernels still
  to read the buffer, is faster.

Candidates: the default layout and ``with_stick_dim(k)`` for every other
host dim whose layout takes at most ``MAX_STICK_RATIO`` of the default's
sticks (padding and alignment are what a layout changes in the timing
model).  A non-default layout must save ``MIN_GAIN`` of the modelled time.

The restickified copy is a temporary device buffer of exactly the target
layout's device elements, launched before its first reader (the profiler
shows ``restickify_<buffer>``); a buffer stored in a non-default layout
keeps the allocation Inductor made (the layouts chosen never take more
device elements than the default).

Not yet: matmul operands and outputs (the matmul planner's splits and tiles
assume the default stick dims), buffers read through a reshape view, slice
or sub-block, and layouts other than one stick dim per buffer.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torch_spyre.compiler import graph_state
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import Buffer, Load, ProgramError, Store
from torch_spyre.kernels.search import Found, Search
from torch_spyre.layout import SpyreTensorLayout
from torch_spyre.sim import estimate

#: choose layouts by cost (False: every operand in its buffer's default
#: layout; for comparisons).  Part of no cache key: compile afresh after
#: changing it (``torch._dynamo.reset()``, FX graph cache off)
ENABLED = True

#: a non-default layout must save this fraction of the consumer's modelled
#: time (restickify included) to be chosen
MIN_GAIN = 0.02

#: operand layouts taking at most this fraction of the default's sticks are
#: candidates (fewer bytes is what a layout buys in the timing model)
MAX_STICK_RATIO = 0.75

#: decisions made in this process, newest last: (buffer, layout, modelled
#: seconds with the default layout, with the chosen one, restickify included)
DECISIONS: list[tuple[str, SpyreTensorLayout, float, float]] = []


def candidates(size: tuple[int, ...], dtype: torch.dtype) -> list[SpyreTensorLayout]:
    """Layouts of a buffer of ``size`` worth costing: the default first, then
    every other stick dim whose layout takes clearly fewer sticks."""
    size = tuple(int(s) for s in size)
    base = SpyreTensorLayout.default(size, dtype)
    out = [base]
    for k in range(len(size) - 1):
        if size[k] < 2:
            continue
        lay = SpyreTensorLayout.with_stick_dim(size, dtype, k)
        if lay.num_sticks <= MAX_STICK_RATIO * base.num_sticks:
            out.append(lay)
    return out


def restickify_plan(src: SpyreTensorLayout, dst: SpyreTensorLayout, buffer: str, target: str, cfg):
    """The kernel program that copies a buffer from layout ``src`` to ``dst``
    (same host sizes): tiles loaded in sticks of one dim, stored in sticks of
    the other; core split and tiles chosen like any row kernel's."""
    from torch_spyre.compiler.kernel_plan import OperandUse, Plan
    from torch_spyre.kernels import plan as planner
    from torch_spyre.kernels.search import Unsupported

    if src.host_size != dst.host_size or src.dtype != dst.dtype:
        raise ValueError(f"restickify between {src} and {dst}: host sizes and dtypes must match")
    sizes = {f"d{k}": s for k, s in enumerate(src.host_size) if s > 1}
    index = tuple(f"d{k}" if s > 1 else None for k, s in enumerate(src.host_size))
    if not sizes:
        raise Unsupported("restickify of a one-element buffer")
    dims = tuple(sorted(sizes, key=lambda d: int(d[1:])))
    buffers = {"t0": Buffer("t0", dims, src.dtype, double_buffered=True)}
    steps = [Load("t0", "in0", index), Store("ou1", "t0", index)]
    ops = [
        OperandUse("in0", buffer, "input", src, src.host_size),
        OperandUse("ou1", target, "output", dst, (dst.device_numel,)),
    ]
    prog = planner._plan_dims(f"restickify_{buffer}", steps, buffers, ops, sizes, set(), cfg)
    return Plan(prog, ops)


def _plain_input(use, buffer_info) -> tuple | None:
    """(size, dtype) of an input operand that reads its whole buffer in the
    buffer's default layout (no view, slice or sub-block), else None."""
    if use.role != "input" or use.start or use.load_offsets or not use.shape:
        return None
    try:
        size, stride, offset, dtype = buffer_info(use.buffer)
    except KeyError:
        return None
    size = tuple(size)
    contiguous = SpyreTensorLayout.default(size, dtype).host_strides
    if (
        offset
        or tuple(stride) != contiguous
        or use.layout != SpyreTensorLayout.default(size, dtype)
    ):
        return None
    return size, dtype


def _graph():
    """The graph being compiled (None outside Inductor's codegen)."""
    try:
        from torch._inductor.virtualized import V

        g = V.graph
        g.wrapper_code  # noqa: B018 - raises outside a graph
        return g
    except Exception:
        return None


def copies() -> dict:
    """Restickified copies already launched in this graph: (buffer, layout) ->
    the wrapper variable holding it (filled as kernels are emitted)."""
    state = graph_state.current()
    return {} if state is None else state.relaid


def _readers(buffer: str) -> int:
    """Kernels of this graph that read ``buffer`` and are not emitted yet (the
    restickify cost is shared by them: each later one reads the same copy)."""
    g = _graph()
    sched = getattr(g, "scheduler", None)
    if sched is None:
        return 1
    n = -graph_state.of(g.wrapper_code).reads.get(buffer, 0)
    for node in sched.nodes:
        if node.is_extern():
            continue
        if any(d.name == buffer for d in node.read_writes.reads):
            n += 1
    return max(n, 1)


def _mutated(buffer: str) -> bool:
    g = _graph()
    if g is None:
        return False
    return buffer in getattr(g, "mutated_buffers", ()) or buffer in getattr(g, "mutated_inputs", ())


#: layouts tried while costing a producer's readers (``consumers_cost``),
#: and how deep such costings are nested (no choices are made inside one)
_TRIAL: dict[str, SpyreTensorLayout] = {}
_COSTING = [0]


def layout_of(buffer: str) -> SpyreTensorLayout | None:
    """The layout ``buffer`` is stored in when it is not the default: chosen
    for a computed intermediate by its producer (``choose_output``), or
    being tried.  None: the default."""
    if buffer in _TRIAL:
        return _TRIAL[buffer]
    state = graph_state.current()
    return None if state is None else state.layouts.get(buffer)


def consumers_cost(
    backend, group: set[str], cfg: HardwareConfig, buffer: str, layout: SpyreTensorLayout
):
    """Modelled seconds on ``cfg`` of the kernels that read ``buffer`` (outside
    the producer's ``group``) when it is stored in ``layout``: each reading
    fused group is planned with it by ``backend`` (the scheduling's
    ``_plain`` / ``_plan``).  None when a reader is not a row kernel (a
    matmul, a fallback kernel, the graph output), or cannot read it so."""
    from torch._inductor.scheduler import BaseSchedulerNode

    from torch_spyre.kernels.search import Unsupported

    g = _graph()
    sched = getattr(g, "scheduler", None)
    buf = sched.name_to_buf.get(buffer) if sched is not None else None
    if buf is None or buffer in g.get_output_names() or _mutated(buffer):
        return None
    try:  # a contiguous buffer Inductor allocates whole (its memory is bound as is)
        fixed = buf.node.get_layout()
        size = tuple(int(x) for x in fixed.size)
        stride = tuple(int(x) for x in fixed.stride)
        if (
            int(fixed.offset)
            or stride != SpyreTensorLayout.default(size, layout.dtype).host_strides
        ):
            return None
    except (TypeError, AttributeError):
        return None
    groups: dict[str, object] = {}
    for u in buf.users:
        if not isinstance(u.node, BaseSchedulerNode):  # the graph output
            return None
        if u.node.get_name() in group:
            continue
        fused = sched.name_to_fused_node.get(u.node.get_name(), u.node)
        if not backend._plain(fused):
            return None
        groups[fused.get_name()] = fused
    if not groups:
        return None
    total = 0.0
    if layout != SpyreTensorLayout.default(layout.host_size, layout.dtype):
        _TRIAL[buffer] = layout
    _COSTING[0] += 1
    try:
        for fused in groups.values():
            plan = backend._plan(list(fused.get_nodes()))
            total += estimate(plan.program, cfg).time_s
            total += sum(estimate(p.program, cfg).time_s for p in plan.pre)
    except (Unsupported, ProgramError):
        return None
    finally:
        _TRIAL.pop(buffer, None)
        _COSTING[0] -= 1
    return total


def choose_output(plan, replan, readers_cost, cfg: HardwareConfig):
    """``plan`` (a producer) with an output stored in a non-default layout
    where the producer's and its readers' modelled time say it pays
    (``readers_cost(buffer, layout)``: seconds of the kernels reading it, or
    None when they cannot read it so).  No restickify: the producer writes
    the layout its readers prefer."""
    from torch_spyre.compiler.kernel_plan import Plan

    if not ENABLED or _COSTING[0]:  # no choices inside the costing of another one
        return plan
    outs = [
        u
        for u in plan.operands
        if u.role == "output"
        and u.shape
        and not u.start
        and u.layout == SpyreTensorLayout.default(u.shape, u.layout.dtype)
    ]
    for u in outs:
        cands = candidates(u.shape, u.layout.dtype)[1:]
        if not cands:
            continue
        base_readers = readers_cost(u.buffer, u.layout)
        if base_readers is None:
            continue
        base_t = estimate(plan.program, cfg).time_s + base_readers

        def build(lay, u=u, plan=plan):
            ops = [replace(u, layout=lay) if x is u else x for x in plan.operands]
            prog = replan(ops)
            return Plan(prog, ops, plan.removed, plan.after, plan.pre), readers_cost(u.buffer, lay)

        found = Search(
            build, cfg, validate=False, fits=lambda b: b[1] is not None,
            cost=lambda b: estimate(b[0].program, cfg).time_s + b[1],
            baseline=Found(None, (plan, base_readers), base_t),
        )  # fmt: skip
        best = found.run(cands)
        if best.candidate is not None and best.time_s <= base_t * (1 - MIN_GAIN):
            DECISIONS.append((u.buffer, best.candidate, base_t, best.time_s))
            plan = best.result[0]
    return plan


def choose(plan, replan, buffer_info, cfg: HardwareConfig):
    """``plan`` with input operands re-laid where the cost model says it
    pays: returns the plan (unchanged, or re-planned with ``plan.pre``
    holding the restickify plans to launch first).  ``replan(ops)`` plans the
    same kernel with other operand layouts."""
    from torch_spyre.compiler.kernel_plan import Plan

    if not ENABLED:
        return plan
    todo = [(u, _plain_input(u, buffer_info)) for u in plan.operands if not _mutated(u.buffer)]
    todo = [(u, info) for u, info in todo if info is not None]
    if not todo:
        return plan
    choices = [(u, info, candidates(*info)[1:]) for u, info in todo]
    if not any(c for _, _, c in choices):
        return plan
    base_t = estimate(plan.program, cfg).time_s
    done = copies()

    def build(c):
        u, lay = c
        have = done.get((u.buffer, lay))
        target = have or f"{u.buffer}_st{lay.stick_dim}"
        new_u = replace(u, layout=lay, buffer=target, shape=(lay.device_numel,))
        ops = [new_u if x is u else x for x in plan.operands]
        prog = replan(ops)
        pre = None if have else restickify_plan(u.layout, lay, u.buffer, target, cfg)
        pres = [*plan.pre, pre] if pre is not None else list(plan.pre)
        return Plan(prog, ops, plan.removed, plan.after, pres), pre, u.buffer

    def cost(built) -> float:
        chosen, pre, buffer = built
        # the copy is made once and read by every kernel that reads the
        # buffer: each pays its share
        t = estimate(chosen.program, cfg).time_s
        if pre is not None:
            t += estimate(pre.program, cfg).time_s / _readers(buffer)
        return t

    found = Search(
        build, cfg, validate=False, cost=cost, baseline=Found(None, (plan, None, None), base_t)
    )
    best = found.run((u, lay) for u, _info, cands in choices for lay in cands)
    t, chosen = best.time_s, best.result[0]
    if best.candidate is None or t > base_t * (1 - MIN_GAIN):
        return plan
    if _COSTING[0]:  # a reader planned to cost its producer's choice
        return chosen
    DECISIONS.append((best.candidate[0].buffer, best.candidate[1], base_t, t))
    if len(DECISIONS) > 256:
        del DECISIONS[:128]
    return chosen
