"""The simulated card: validates, executes and times kernels, models copies.

Each card keeps a modelled clock: kernels and transfers run one after another
(the runtime launches synchronously), so a record starts where the previous
one ended.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from torch_spyre import settings
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import GroupedProgram, Program
from torch_spyre.sim import trace
from torch_spyre.sim.executor import runner
from torch_spyre.sim.grouped import estimate_grouped
from torch_spyre.sim.timing import KernelReport, estimate

MAX_CARDS = 8
TRANSFER_KINDS = ("h2d", "d2h", "d2d")

_timing_only_depth = 0
#: the flag launches read: the setting (``TORCH_SPYRE_TIMING_ONLY``), or
#: inside ``timing_only()``
_timing_only = settings.get().timing_only


def _timing_only_setting(s: settings.Settings) -> None:
    global _timing_only
    _timing_only = _timing_only_depth > 0 or s.timing_only
    _notify()


settings.watch(_timing_only_setting)


def timing_only_active() -> bool:
    """True inside ``timing_only()`` or with the ``timing_only`` setting
    (``TORCH_SPYRE_TIMING_ONLY=1``)."""
    return _timing_only


@contextlib.contextmanager
def timing_only() -> Iterator[None]:
    """Kernel programs are validated, timed and traced, but not executed.

    For performance studies of shapes too big to compute on the host (the
    functional executor runs fp16 programs as fp32 torch ops): every
    ``SimulatedCard.run`` with buffers skips the executor, so the clock,
    profiler and reports are exactly those of a real run while output device
    memory keeps whatever it held (unspecified values).  Transfers, host
    fallbacks and copies still run.  Process-wide (all threads), nestable;
    the environment variable ``TORCH_SPYRE_TIMING_ONLY=1`` turns it on for a
    whole process.
    """
    global _timing_only_depth, _timing_only
    _timing_only_depth += 1
    _timing_only = True
    _notify()
    try:
        yield
    finally:
        _timing_only_depth -= 1
        _timing_only = _timing_only_depth > 0 or settings.get().timing_only
        _notify()


#: told when timing-only runs or trace listening may have changed (``watch``)
_watchers: list[Callable[[], None]] = []


def _notify() -> None:
    for fn in _watchers:
        fn()


def watch(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever ``timing_only_active()`` or ``trace.listening()``
    may have changed: a launch path that neither executes through the card nor
    emits records (the runtime's C++ warm path) must then stand aside."""
    _watchers.append(fn)
    trace.watch(fn)


#: ``drain(index, clock_s, kernel_time_s)``: launches that the runtime accounted
#: outside Python on card ``index`` since the last call, replayed in order onto
#: the given clock and kernel time: None, or (clock_s, kernel_time_s, kernels)
Drain = Callable[[int, float, float], tuple[float, float, int] | None]
_drain: Drain | None = None
#: told when the cards are rebuilt (``reset_cards``: modelled times may change)
_on_reset: list[Callable[[], None]] = []


def on_reset(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after ``reset_cards`` (state kept per card must go)."""
    _on_reset.append(fn)


def bind_launches(drain: Drain) -> None:
    """Connect the process's cards to launches accounted outside Python (the
    runtime does it): each card replays them (``drain``) before its clock or
    counters are read or moved, so they are the same additions in the same
    order as if ``account`` had made them."""
    global _drain
    _drain = drain
    for card in list(_cards.values()):
        card._drain = drain


@dataclass
class CardStats:
    kernels: int = 0
    kernel_time_s: float = 0.0
    transfers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0))
    transfer_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0))
    transfer_time_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0.0)
    )
    #: card-to-card collectives (sim/interconnect.py): count, bytes, link time,
    #: and time spent waiting for the slowest card to arrive
    collectives: int = 0
    collective_bytes: int = 0
    collective_time_s: float = 0.0
    collective_wait_s: float = 0.0


class SimulatedCard:
    def __init__(self, index: int = 0, config: HardwareConfig | None = None) -> None:
        if not 0 <= index < MAX_CARDS:
            raise ValueError(f"card index must be 0..{MAX_CARDS - 1}, got {index}")
        self.index = index
        self.config = config or HardwareConfig.from_env()
        self._clock_s = 0.0
        self._stats = CardStats()
        self._lock = threading.Lock()
        #: set on the process's cards (``get_card``) once launches can be
        #: accounted outside Python (``bind_launches``)
        self._drain: Drain | None = None
        # timing depends only on (program, config): cache it per program
        self._reports: dict[str, KernelReport] = {}

    def __repr__(self) -> str:
        return f"SimulatedCard(index={self.index}, clock_s={self.clock_s:.6g})"

    @property
    def clock_s(self) -> float:
        """The modelled clock (seconds)."""
        if self._drain is not None:
            with self._lock:
                self._sync()
        return self._clock_s

    def _sync(self) -> None:
        """Add the launches accounted outside Python (caller holds ``_lock``)."""
        if self._drain is None:
            return
        got = self._drain(self.index, self._clock_s, self._stats.kernel_time_s)
        if got is not None:
            self._clock_s, self._stats.kernel_time_s, n = got
            self._stats.kernels += n

    # ------------------------------------------------------------ kernels
    def estimate(self, program: Program | GroupedProgram) -> KernelReport:
        """Validate and time ``program`` without running it or advancing the clock."""
        key = program.to_json()
        rep = self._reports.get(key)
        if rep is None:
            program.validate(self.config)
            if isinstance(program, GroupedProgram):
                rep = estimate_grouped(program, self.config)
            else:
                rep = estimate(program, self.config)
            if len(self._reports) > 4096:
                self._reports.clear()
            self._reports[key] = rep
        return rep

    def run(
        self,
        program: Program | GroupedProgram,
        buffers: dict[str, torch.Tensor] | None = None,
        report: KernelReport | None = None,
    ) -> KernelReport:
        """Validate, execute on ``buffers`` (None, or inside ``timing_only()``: time
        only), time, advance the clock.

        ``report``: this card's ``estimate(program)``, when the caller cached it
        (eager ops launch the same program many times; keying the card's own
        cache serialises the program on every launch).
        """
        rep = report or self.estimate(program)
        if buffers is not None and not _timing_only:
            if isinstance(program, GroupedProgram):
                for phase in program.phases:  # one launch, the phases in turn
                    runner(phase)(buffers)
            else:
                runner(program)(buffers)
        return self.account(rep)

    def account(self, rep: KernelReport) -> KernelReport:
        """Advance the clock and the counters by one launch of ``rep``'s kernel
        (``run`` without the execution: for callers that executed it themselves)."""
        with self._lock:
            self._sync()
            start = self._clock_s
            self._clock_s += rep.time_s
            self._stats.kernels += 1
            self._stats.kernel_time_s += rep.time_s
        if trace.listening():
            trace.emit(trace.KernelRecord(self.index, start, rep))
        return rep

    # ---------------------------------------------------------- transfers
    def transfer_time(self, kind: str, nbytes: int) -> float:
        cfg = self.config
        if kind in ("h2d", "d2h"):
            # PCIe Gen5 x16, one direction: fixed latency + bytes at link rate
            return cfg.pcie_latency_s + nbytes / cfg.pcie_bandwidth_Bps
        if kind == "d2d":
            # a DMA that reads and writes LPDDR5: both directions use its bandwidth
            return cfg.dma_setup_cycles / cfg.clock_hz + 2 * nbytes / cfg.sustained_bandwidth_Bps
        raise ValueError(f"transfer kind must be one of {TRANSFER_KINDS}, got {kind!r}")

    def record_transfer(self, kind: str, nbytes: int, label: str = "") -> trace.TransferRecord:
        if nbytes < 0:
            raise ValueError(f"transfer of {nbytes} bytes")
        t = self.transfer_time(kind, int(nbytes))
        with self._lock:
            self._sync()
            start = self._clock_s
            self._clock_s += t
            st = self._stats
            st.transfers[kind] += 1
            st.transfer_bytes[kind] += int(nbytes)
            st.transfer_time_s[kind] += t
        rec = trace.TransferRecord(self.index, kind, int(nbytes), start, t, label)
        trace.emit(rec)
        return rec

    # -------------------------------------------------------- collectives
    def record_collective(
        self, op: str, nbytes: int, time_s: float, start_s: float | None = None
    ) -> trace.TransferRecord:
        """A collective with the other cards: the clock moves to ``start_s`` (when
        the last card arrived, default now; never backwards) and then ``time_s``
        on (sim/interconnect.py gives it)."""
        if nbytes < 0 or time_s < 0:
            raise ValueError(f"collective {op}: {nbytes} bytes in {time_s} s")
        with self._lock:
            self._sync()
            now = self._clock_s
            start = max(now, now if start_s is None else start_s)
            wait = start - now
            self._clock_s = start + time_s
            st = self._stats
            st.collectives += 1
            st.collective_bytes += int(nbytes)
            st.collective_time_s += time_s
            st.collective_wait_s += wait
        rec = trace.TransferRecord(self.index, "c2c", int(nbytes), start, time_s, op)
        trace.emit(rec)
        return rec

    # -------------------------------------------------------------- stats
    def stats(self) -> dict:
        with self._lock:
            self._sync()
        st = self._stats
        return {
            "card": self.index,
            "clock_s": self._clock_s,
            "kernels": st.kernels,
            "kernel_time_s": st.kernel_time_s,
            "transfers": dict(st.transfers),
            "transfer_bytes": dict(st.transfer_bytes),
            "transfer_time_s": dict(st.transfer_time_s),
            "collectives": st.collectives,
            "collective_bytes": st.collective_bytes,
            "collective_time_s": st.collective_time_s,
            "collective_wait_s": st.collective_wait_s,
        }

    def reset(self) -> None:
        """Zero the clock and the counters (the config stays)."""
        with self._lock:
            self._sync()  # launches before the reset are not counted after it
            self._clock_s = 0.0
            self._stats = CardStats()


_cards: dict[int, SimulatedCard] = {}
_cards_lock = threading.Lock()


def get_card(index: int = 0) -> SimulatedCard:
    """The process-wide card ``index``, built from ``HardwareConfig.from_env()`` on first use."""
    if not 0 <= index < MAX_CARDS:
        raise ValueError(f"card index must be 0..{MAX_CARDS - 1}, got {index}")
    card = _cards.get(index)
    if card is not None:  # the hot path: no lock once the card exists
        return card
    with _cards_lock:
        card = _cards.get(index)
        if card is None:
            card = _cards[index] = SimulatedCard(index, _override or HardwareConfig.from_env())
            card._drain = _drain
        return card


_override: HardwareConfig | None = None


def reset_cards(config: HardwareConfig | None = None) -> None:
    """Forget every card; the next ``get_card`` builds it from ``config`` or the environment.

    For tests and design studies.  The runtime must not hold device memory of
    the old cards when their capacity changes.
    """
    global _override
    with _cards_lock:
        for card in _cards.values():  # their launches stay theirs
            with card._lock:
                card._sync()
        _cards.clear()
        _override = config
    for fn in _on_reset:
        fn()
