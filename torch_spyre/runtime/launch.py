"""The kernel cache and the launch of kernel programs on a card.

A kernel is built once per key (op, shapes, dtypes, static arguments): its
program, the output metadata, and its modelled report per card.  A warm
launch only binds device memory and runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_spyre import _C
from torch_spyre.ir import Program, ProgramError
from torch_spyre.ir import vector_ops as sim_ops
from torch_spyre.runtime import cards, operands
from torch_spyre.sim import KernelReport, timing_only_active
from torch_spyre.sim.card import StreamError
from torch_spyre.sim.executor import IntegerRangeError, runner


@dataclass
class Kernel:
    program: Program
    #: what the producer needs again on a warm call (output shape, dtype, ...)
    info: dict[str, Any] = field(default_factory=dict)
    _reports: dict[int, KernelReport] = field(default_factory=dict)

    def report(self, device: int) -> KernelReport:
        rep = self._reports.get(device)
        if rep is None:
            rep = self._reports[device] = cards.card(device).estimate(self.program)
        return rep

    def launch(self, tensors: dict[str, torch.Tensor]) -> KernelReport:
        """Run on the card of the operands; ``tensors`` are whole spyre tensors."""
        device = next(iter(tensors.values())).device.index
        return self.launch_memory(
            device, {name: operands.device_memory(t) for name, t in tensors.items()}
        )

    def launch_memory(self, device: int, buffers: dict[str, torch.Tensor]) -> KernelReport:
        """Run on card ``device``; ``buffers`` are the operands' device memory."""
        rep = cards.card(device).run(self.program, buffers, self.report(device))
        return rep

    def prepare(self, device: int) -> Prepared:
        """The kernel resolved for card ``device`` (its report and runner), for
        callers that launch it again and again (``Prepared.launch``)."""
        return Prepared(self, device)

    def model_only(self, device: int) -> KernelReport:
        """Model the program on the card; the caller computed the result itself."""
        rep = cards.card(device).run(self.program, None, self.report(device))
        return rep


class Prepared:
    """A kernel ready to launch on one card: the card, the program's report on
    it and, when the program is the executor's one-op elementwise form, its
    unchecked runner (``fast``, with the executor's ``form`` of the op): a
    launch then skips the card's generic run (runner lookup, operand checks)
    but accounts the same time.  Rebuild it after ``cards`` are reset."""

    __slots__ = ("kernel", "card", "report", "fast", "form")

    def __init__(self, kernel: Kernel, device: int) -> None:
        self.kernel = kernel
        self.card = cards.card(device)
        self.report = kernel.report(device)
        self.fast = getattr(runner(kernel.program), "unchecked", None)
        self.form = getattr(self.fast, "form", None)

    def launch(self, buffers: dict[str, torch.Tensor]) -> KernelReport:
        """Run on the operands' device memory ``buffers`` and account it."""
        if self.fast is None:
            return self.card.run(self.kernel.program, buffers, self.report)
        self.card.check_stream()
        if not timing_only_active():
            try:
                self.fast(buffers)
            except (ProgramError, IntegerRangeError):
                raise
            except Exception as err:
                self.card.fail_stream(
                    f"kernel {self.kernel.program.name!r} failed on the card: {err}"
                )
                raise StreamError(self.card.index, self.card.stream_error()) from err
        return self.card.account(self.report)


_cache: dict[Any, Kernel] = {}
_stats = {"hits": 0, "misses": 0}


#: kernels kept before the cache is cleared
MAX_KERNELS = 8192


def kernel(key: Any, build: Callable[[], Kernel]) -> Kernel:
    """The cached kernel for ``key``; ``build()`` on a miss.

    A program the card rejects (e.g. a row that does not fit the LX) leaves a
    kernel with ``program=None`` and the reason in ``info["rejected"]``: the
    op then runs through the host fallback, where it is counted.
    """
    k = _cache.get(key)
    if k is None:
        if len(_cache) >= MAX_KERNELS:
            # before the build: clearing forgets the vector ops the eager
            # layer registered, and the new kernel's program may name one it
            # registers now (cleared after, it failed at launch: "unknown
            # vector op", found by the fuzzer's long run)
            clear_cache()
        _stats["misses"] += 1
        k = build()
        if k.program is not None:
            try:
                k.report(0)
            except ProgramError as err:
                k = Kernel(None, {**k.info, "rejected": str(err)})  # type: ignore[arg-type]
        _cache[key] = k
    else:
        _stats["hits"] += 1
    return k


def record_hit() -> None:
    """A producer's own warm-call cache served a kernel of this cache."""
    _stats["hits"] += 1


#: producers' caches of kernels from this one (forgotten with it)
_dependents: list[Callable[[], None]] = []


def on_clear(forget: Callable[[], None]) -> None:
    _dependents.append(forget)


def cache_info() -> dict[str, int]:
    _stats["hits"] += _C._warm_take_hits()  # launches the C++ warm path served
    return {**_stats, "size": len(_cache)}


def clear_cache() -> None:
    """Forget every kernel, and the vector ops the eager layer registered for
    them (named "aten.*": one per op and static arguments, e.g. per scalar)."""
    _cache.clear()
    for forget in _dependents:
        forget()
    _C._warm_take_hits()
    _stats.update(hits=0, misses=0)
    for registry in (sim_ops.VECTOR_OPS, sim_ops.REDUCTIONS):
        for name in [n for n in registry if n.startswith("aten.")]:
            del registry[name]
