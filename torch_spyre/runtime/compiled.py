"""What compiled code runs: kernel programs from the generated wrapper, launched on the card.

The wrapper module Inductor writes for a spyre graph holds each fused kernel
as the JSON of its kernel program (so the FX graph cache replays the very
program that was planned) and calls ``CompiledKernel.run`` with the graph's
tensors.  Launch goes through ``torch_spyre.runtime.launch.Kernel``, like eager
ops: the modelled report is computed once per card, a warm launch binds
device memory and runs.
"""

from __future__ import annotations

import collections
import functools
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_spyre import settings
from torch_spyre.ir import Program, constants
from torch_spyre.runtime import dispatch_stats, launch, operands


class CompiledKernel:
    """One planned kernel program and how the wrapper's tensors bind to it."""

    def __init__(
        self, program_json: str, bindings: list[tuple[str, str, tuple[int, ...], int, int]]
    ):
        self.program = Program.from_json(program_json)
        #: (operand name, role, shape of the wrapper tensor bound to it, first
        #: device element and device elements of the operand's view)
        self.bindings = bindings
        #: each operand's device shape: a wrapper tensor is bound in it (a
        #: [2, 1536] tensor the program reads as [2, 48, 32] has the same
        #: bytes in other dims; the executor takes operands as shaped)
        self._sizes = {o.name: tuple(o.layout.device_size) for o in self.program.operands}
        self._kernel = launch.Kernel(self.program)
        self._label = "compiled." + self.program.name
        self._iotas: dict[tuple[int, int | None], torch.Tensor] = {}
        self._tables: dict[tuple[str, int | None], torch.Tensor] = {}
        if settings.get().debug:
            print(self.program.dump())

    def _iota(self, n: int, device: torch.device) -> torch.Tensor:
        """A constant index table on the card (copied once per kernel and card)."""
        key = (n, device.index)
        t = self._iotas.get(key)
        if t is None:
            t = self._iotas[key] = torch.arange(n, dtype=torch.float32).to(device)
        return t

    def _eye(self, name: str, shape, device: torch.device) -> torch.Tensor:
        """A lane-gather table (``ir/constants.py``), copied once per kernel and card."""
        key = (name, device.index)
        t = self._tables.get(key)
        if t is None:
            dtype = self.program.operand(name).layout.dtype
            pieces = list(zip(shape[2::2], shape[3::2]))  # (size, lane stride) per piece
            host = constants.table(shape[0], shape[1], pieces, dtype)
            t = self._tables[key] = host.to(device)
        return t

    def run(self, *tensors: torch.Tensor) -> None:
        device = tensors[0].device
        bind: dict[str, torch.Tensor] = {}
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        it = iter(tensors)
        for name, role, shape, start, numel in self.bindings:
            if role == "iota":
                bind[name] = operands.device_memory(self._iota(shape[0], device))
                continue
            if role == "eye":
                bind[name] = operands.device_memory(self._eye(name, shape, device))
                continue
            t = next(it)
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(
                    f"spyre compiled kernel {self.program.name!r}: operand {name!r} expected "
                    f"shape {tuple(shape)}, got {tuple(t.shape)} (recompile with dynamic=False)"
                )
            if role == "input":
                mem = operands.memory(t)
                if start or mem.numel() != numel:  # a slice: one block of its sticks
                    if start < 0 or start + numel > mem.numel():
                        raise RuntimeError(
                            f"spyre compiled kernel {self.program.name!r}: operand {name!r} "
                            f"reads elements {start}..{start + numel} of a tensor holding "
                            f"{mem.numel()} (a planner bug)"
                        )
                    mem = mem.reshape(-1)[start : start + numel]
                bind[name] = mem if mem.shape == self._sizes[name] else mem.view(self._sizes[name])
            elif operands.is_whole_default(t):
                mem = operands.device_memory(t)
                if mem.numel() != numel:  # stored in a compacter layout (compiler.layouts)
                    mem = mem.reshape(-1)[:numel]
                bind[name] = mem if mem.shape == self._sizes[name] else mem.view(self._sizes[name])
            else:  # an output Inductor allocated with another stride: store, then re-lay
                tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                bind[name] = operands.device_memory(tmp)
                if bind[name].numel() != numel:
                    raise RuntimeError(
                        f"spyre compiled kernel {self.program.name!r}: operand {name!r} is "
                        "stored in a non-default layout into a strided buffer (a planner bug)"
                    )
                copy_back.append((t, tmp))
        dispatch_stats.record("kernel", self._label)
        self._kernel.launch_memory(device.index or 0, bind)
        for t, tmp in copy_back:
            t.copy_(tmp)


def load_constants(module: dict[str, Any], names: tuple[str, ...]) -> None:
    """Lay the graph's spyre constants out on the card, once per loaded module.

    A graph compiled in this process holds its constants (a RoPE rotation's
    signed permutation, ``compiler/passes.py``) as tensors made on the card
    while compiling, in their default stick layout.  A graph loaded from
    Inductor's FX-graph cache gets them back unpickled into linear storages,
    which a first launch would re-lay (``operands._adopted``) and bill to the
    caller's first run: a warm cache would then model another time than a
    cold compile (60 re-lays of 8 KiB in SmolLM2's prefill).  Laying them out
    here is loading the program, as the cold compile's upload was: executed,
    unbilled (``sim.card.compiling``).  The wrapper's ``call`` runs this first
    (``SpyreWrapperCodegen.codegen_inputs``); later calls find the flag set."""
    if module.get("_spyre_constants_laid"):
        return
    from torch_spyre.runtime import access
    from torch_spyre.sim import card

    with card.compiling():
        for name in names:
            t = module.get(name)
            if (
                isinstance(t, torch.Tensor)
                and t.device.type == "spyre"
                and access.is_whole_linear(t)
            ):
                access.adopt_default(t)
    module["_spyre_constants_laid"] = True


def kernel_from_json(program_json: str, bindings: Any) -> CompiledKernel:
    return CompiledKernel(program_json, [(n, r, tuple(s), o, k) for n, r, s, o, k in bindings])


#: names the generated code of a degraded node may use (compiler/eager_nodes.py)
_EAGER_GLOBALS = {
    "torch": torch,
    "device": torch.device,
    "inf": math.inf,
    "nan": math.nan,
    "operator": operator,
    "NoneType": type(None),
}


class SpyreCompileWarning(UserWarning):
    """Part of a compiled graph runs as eager kernels (or on the host) on spyre."""


#: degrade reasons already warned about in this process (once per reason)
_warned: set[str] = set()


#: degrade steps of the graphs loaded in this process, by kind
_loaded: collections.Counter[str] = collections.Counter()


def loaded_degrade_steps() -> dict[str, int]:
    """Degrade steps (kind -> count) of every compiled graph this process has
    loaded, fresh from the compiler or from Inductor's cache alike (the
    compiler's own ``degrade.counts()`` sees fresh compiles only)."""
    return dict(_loaded)


def note_degraded(steps: list[tuple[str, str, str]]) -> None:
    """Called by a compiled graph's module when it loads (fresh from the
    compiler or from Inductor's cache) with the degrade steps its compile took
    (``compiler/degrade.py``: kind, what, reason): warns once per reason under
    ``compile_fallback=warn`` and refuses the graph under ``error``, so a
    cached graph reports what a fresh compile would."""
    policy = settings.get().compile_fallback
    for kind, what, reason in steps:
        _loaded[kind] += 1
        if kind == "split":
            continue
        message = f"spyre compiler: {what}: {reason}"
        if policy == "error":
            raise RuntimeError(
                message + " (TORCH_SPYRE_COMPILE_FALLBACK=error: degrading is off; this "
                "graph came from a compile that degraded: set it to 'warn', or clear "
                "Inductor's cache and compile again to see the error at its source)"
            )
        key = f"{kind}:{reason[:120]}"
        if policy == "warn" and key not in _warned:
            _warned.add(key)
            warnings.warn(message, SpyreCompileWarning, stacklevel=2)


def eager_function(src: str) -> Callable[..., torch.Tensor]:
    """The function the compiler wrote for a node it could not plan: the FX
    nodes the node came from, as FX's own generated code (``forward``)."""
    env = dict(_EAGER_GLOBALS)
    exec(compile(src, "<spyre degraded node>", "exec"), env)
    return functools.partial(env["forward"], None)


def run_eager(
    fn: Callable[..., torch.Tensor], name: str, out: torch.Tensor | None, *inputs
) -> None:
    """Compute node ``name`` of a compiled graph with eager ops (on the card
    where the eager library has a kernel, else the counted host fallback) and
    store it into the buffer Inductor allocated for it."""
    dispatch_stats.record("degraded", name)
    result = fn(*inputs)
    if out is None:  # run for its effect (an assert)
        return
    if tuple(result.shape) != tuple(out.shape) and result.numel() == out.numel():
        result = result.reshape(out.shape)  # the buffer holds it in another shape
    if tuple(result.shape) != tuple(out.shape):
        raise RuntimeError(
            f"spyre compiled graph: node {name} computed eagerly has shape "
            f"{tuple(result.shape)}, its buffer {tuple(out.shape)} (a compiler bug)"
        )
    out.copy_(result)


def host_function(src: str) -> Callable[..., torch.Tensor]:
    """The host code the compiler wrote from a node's IR (``compiler/host_nodes.py``)."""
    env = {"torch": torch, "math": math, "_ld": _load, "_ldm": _load_masked, "_truncdiv": _truncdiv}
    exec(compile(src, "<spyre host node>", "exec"), env)
    return env["forward"]


def _truncdiv(a, b) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="trunc")


def _load(flat: torch.Tensor, index) -> torch.Tensor:
    """``flat[index]``, every index inside the buffer (a read past it would be
    another buffer's memory: raised, never clamped into a wrong value)."""
    index = torch.as_tensor(index)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= flat.numel()):
        raise RuntimeError(
            f"spyre compiled graph: a host node reads elements {int(index.min())}.."
            f"{int(index.max())} of a buffer of {flat.numel()} (a compiler bug)"
        )
    return flat[index]


def _load_masked(flat: torch.Tensor, index) -> torch.Tensor:
    """``flat[index]`` under a mask: the lanes it drops may index outside."""
    index = torch.as_tensor(index)
    return flat[index.clamp(0, max(flat.numel() - 1, 0))]


def _storage(t: torch.Tensor) -> torch.Tensor:
    """A host copy of the memory ``t`` views from its first element, flat (the
    IR indexes a buffer from its first element: Inductor's layout of a graph
    input has offset 0 whatever the tensor's storage offset): its elements
    where ``t`` has them, zeros elsewhere.  (Read from the storage's start, a
    graph input ``x[1:2]`` was read as the element before it: fuzzer seed
    807679, a wrong answer.)"""
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    flat = torch.zeros(max(extent, 1) if t.numel() else 1, dtype=t.dtype)
    if t.numel():
        # by position: an expanded tensor (stride 0) has several elements at one
        pos = torch.zeros((), dtype=torch.int64)
        for k, (n, st) in enumerate(zip(t.shape, t.stride())):
            shape = [1] * t.dim()
            shape[k] = n
            pos = pos + torch.arange(n).view(shape) * st
        flat[pos.reshape(-1)] = t.cpu().reshape(-1)
    return flat


def run_host(fn: Callable[..., torch.Tensor], name: str, out: torch.Tensor, *inputs) -> None:
    """Compute node ``name`` of a compiled graph on the host from its IR (the
    last degrade step, counted as a host fallback) and store it into the
    buffer Inductor allocated for it."""
    dispatch_stats.record("degraded", name)
    dispatch_stats.record("fallback", f"compiled.{name}")
    value, index, mode = fn(*[_storage(t) for t in inputs])
    # the IR's store index addresses the output's storage: a node may write
    # part of another buffer (a copy into a view of it, a scatter)
    flat = _storage(out)
    if mode == "atomic_add":  # a scatter-add: repeated indices accumulate
        flat.index_put_((index.reshape(-1),), value.reshape(-1).to(flat.dtype), accumulate=True)
    else:
        flat[index.reshape(-1)] = value.reshape(-1)
    out.copy_(flat.as_strided(out.shape, out.stride(), 0).to(out.device))


def out_via_eager(op, out: torch.Tensor, *args, **kwargs) -> None:
    """An extern kernel the planner did not take: its eager device kernel, then
    a device copy into the buffer Inductor allocated."""
    out.copy_(op(*args, **kwargs).view(out.shape))
