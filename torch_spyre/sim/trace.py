"""The trace sink: every kernel and transfer a simulated card models.

The profiler (or anything else) subscribes with ``add_listener``; cards call
``emit``.  With no listener, emitting costs one empty-list check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_spyre.sim.timing import KernelReport


@dataclass(frozen=True)
class KernelRecord:
    card: int
    #: card clock (modelled seconds) when the kernel started
    start_s: float
    report: KernelReport

    @property
    def name(self) -> str:
        return self.report.name

    @property
    def time_s(self) -> float:
        return self.report.time_s

    @property
    def end_s(self) -> float:
        return self.start_s + self.report.time_s


@dataclass(frozen=True)
class TransferRecord:
    card: int
    kind: str  # "h2d" | "d2h" | "d2d" | "c2c" (a collective; label: its name)
    nbytes: int
    start_s: float
    time_s: float
    #: what the copy was for, e.g. "fallback aten.histc.default" ("" for a user copy)
    label: str = ""

    @property
    def name(self) -> str:
        what = f"{self.kind} {self.nbytes} B"
        return f"{what} ({self.label})" if self.label else what

    @property
    def end_s(self) -> float:
        return self.start_s + self.time_s

    @property
    def bandwidth_Bps(self) -> float:
        return self.nbytes / self.time_s if self.time_s else 0.0


Record = KernelRecord | TransferRecord
Listener = Callable[[Record], None]

_listeners: list[Listener] = []
#: told when listening() may have changed (a fast path that emits no records
#: must stand aside while anyone listens)
_watchers: list[Callable[[], None]] = []


def add_listener(fn: Listener) -> None:
    _listeners.append(fn)
    for watch in _watchers:
        watch()


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)
    for watch in _watchers:
        watch()


def watch(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever a listener is added or removed."""
    _watchers.append(fn)


def listening() -> bool:
    """Whether anyone collects records (so hot paths can skip building them)."""
    return bool(_listeners)


def emit(record: Record) -> None:
    for fn in list(_listeners):
        fn(record)
