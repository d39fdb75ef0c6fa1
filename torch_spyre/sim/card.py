"""The simulated card: validates, executes and times kernels, models copies.

Each card keeps a modelled clock: kernels and transfers run one after another
(the runtime launches synchronously), so a record starts where the previous
one ended.  The clock and the counters live in the card module
(``torch_spyre._card``, csrc/card/card_api.h), their one owner: the
process's cards use its clocks 0..7, which the runtime's C++ (events, the
warm launch path) reads and moves too; a card made for a study gets a clock
of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from torch_spyre import _card, settings
from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import GroupedProgram, Program, ProgramError
from torch_spyre.sim import trace
from torch_spyre.sim.executor import IntegerRangeError, runner
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


#: inside ``timing_only(compiles=False)``: compilations skip their card work too
_compiles_skip = False


def timing_only_active() -> bool:
    """True inside ``timing_only()`` or with the ``timing_only`` setting
    (``TORCH_SPYRE_TIMING_ONLY=1``), except on a thread that is compiling
    (``compile_started``): what a compilation runs on the card makes
    constants (fills, folded constants, uploaded tables) that every later
    call reads, so it executes (unbilled either way) unless the innermost
    ``timing_only(compiles=False)`` says the compiled code's values do not
    matter."""
    return _timing_only and (_compiles_skip or not _card.unbilled())


@contextlib.contextmanager
def timing_only(compiles: bool = True) -> Iterator[None]:
    """Kernel programs are validated, timed and traced, but not executed.

    For performance studies of shapes too big to compute on the host (the
    functional executor runs fp16 programs as fp32 torch ops): every
    ``SimulatedCard.run`` with buffers skips the executor, so the clock,
    profiler and reports are exactly those of a real run while output device
    memory keeps whatever it held (unspecified values).  Transfers, host
    fallbacks and copies still run.  Process-wide (all threads), nestable;
    the environment variable ``TORCH_SPYRE_TIMING_ONLY=1`` turns it on for a
    whole process.

    ``compiles``: whether the card work of a compilation inside (constants
    it makes, which the compiled code then reads) still executes (the
    default).  ``False`` skips it too, for performance studies only: the
    graphs compiled inside then hold unspecified constants.
    """
    global _timing_only_depth, _timing_only, _compiles_skip
    _timing_only_depth += 1
    _timing_only = True
    outer_skip, _compiles_skip = _compiles_skip, not compiles
    _notify()
    try:
        yield
    finally:
        _compiles_skip = outer_skip
        _timing_only_depth -= 1
        _timing_only = _timing_only_depth > 0 or settings.get().timing_only
        _notify()


def compile_started(*_: object) -> None:
    """The calling thread compiles a graph: what it runs on a card from now on
    (constants read back or uploaded, fills, cache saves and loads) executes
    but does not move the card's clock, its counters or the trace: it is not
    the user's call, and a warm cache would do other work
    (``csrc/card/card.h``, ``set_unbilled``).  Dynamo's compile-start
    callback (``compiler/__init__.py``)."""
    _card.set_unbilled(True)


def compile_ended(*_: object) -> None:
    """The compilation ended: the card bills again (Dynamo's end callback)."""
    _card.set_unbilled(False)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """A compilation outside Dynamo's window (a shape compiled at run time,
    ``compiler/piecewise.compile_outside``): unbilled and executed, as
    between ``compile_started`` and ``compile_ended``; nestable."""
    was = _card.unbilled()
    _card.set_unbilled(True)
    try:
        yield
    finally:
        if not was:
            _card.set_unbilled(False)


def unbilled() -> bool:
    """The calling thread is compiling: its card work is not billed."""
    return _card.unbilled()


#: told when timing-only runs or trace listening may have changed (``watch``)
_watchers: list[Callable[[], None]] = []


def _notify() -> None:
    for fn in _watchers:
        fn()


def watch(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever ``timing_only_active()``, ``trace.listening()`` or a
    card's stream error may have changed: a launch path that neither executes through the card nor
    emits records (the runtime's C++ warm path) must then stand aside."""
    _watchers.append(fn)
    trace.watch(fn)


#: told when the cards are rebuilt (``reset_cards``: modelled times may change)
_on_reset: list[Callable[[], None]] = []


def on_reset(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after ``reset_cards`` (caches of modelled times must go)."""
    _on_reset.append(fn)


class StreamError(RuntimeError):
    """The card's stream is in error: a launch failed on the card, and the card
    refuses work until it is reset."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(
            f"spyre:{index} is in a stream error ({what}); the card refuses work until "
            "it is reset: torch.spyre.reset_device_state() (or restart the process)"
        )
        self.index = index


class SimulatedCard:
    """One card: its hardware config, the timing of its programs, its clock.

    ``clock``: the card module's clock to keep time on (``get_card`` gives the
    process's cards theirs); default a clock of this card's own."""

    def __init__(
        self, index: int = 0, config: HardwareConfig | None = None, clock: _card.Clock | None = None
    ) -> None:
        if not 0 <= index < MAX_CARDS:
            raise ValueError(f"card index must be 0..{MAX_CARDS - 1}, got {index}")
        self.index = index
        self.config = config or HardwareConfig.from_env()
        self._clock = clock if clock is not None else _card.Clock()
        #: one of the process's cards (its clock is the card module's): only
        #: those hold a stream error (a card made for a study has none)
        self._process_card = clock is not None and clock is _card.clock(index)
        # timing depends only on (program, config): cache it per program
        self._reports: dict[str, KernelReport] = {}

    def __repr__(self) -> str:
        return f"SimulatedCard(index={self.index}, clock_s={self.clock_s:.6g})"

    @property
    def clock_s(self) -> float:
        """The modelled clock (seconds)."""
        return self._clock.clock_s

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
        self.check_stream()
        rep = report or self.estimate(program)
        if buffers is not None and not (_timing_only and timing_only_active()):
            try:
                if isinstance(program, GroupedProgram):
                    for phase in program.phases:  # one launch, the phases in turn
                        runner(phase)(buffers)
                else:
                    runner(program)(buffers)
            except (ProgramError, IntegerRangeError):
                raise  # refused before it ran: the binding, or an operand's range
            except Exception as err:
                self.fail_stream(f"kernel {program.name!r} failed on the card: {err}")
                raise StreamError(self.index, self.stream_error()) from err
        return self.account(rep)

    # ------------------------------------------------------- stream error
    def stream_error(self) -> str:
        """What put the card into its stream error ("" when it is healthy).

        A launch that fails while it runs on the card (not one refused
        before it ran: a bad binding, an operand out of range) leaves the
        card's stream in error, as on IBM's runtime: every later launch and
        transfer is refused until the card is reset (``clear_stream_error``;
        ``torch.spyre.reset_device_state()``).  IBM's
        ``torch_spyre._C.get_device_state()`` reads it."""
        return _card.stream_error(self.index) if self._process_card else ""

    def fail_stream(self, what: str) -> None:
        if self._process_card:
            _card.set_stream_error(self.index, what)
            _notify()  # launch paths that bypass ``run`` must stand aside

    def clear_stream_error(self) -> None:
        if self._process_card:
            _card.clear_stream_error(self.index)
            _notify()

    def check_stream(self) -> None:
        """Raise ``StreamError`` when the card's stream is in error."""
        if self._process_card:
            what = _card.stream_error(self.index)
            if what:
                raise StreamError(self.index, what)

    def account(self, rep: KernelReport) -> KernelReport:
        """Advance the clock and the counters by one launch of ``rep``'s kernel
        (``run`` without the execution: for callers that executed it themselves)."""
        start = self._clock.account_kernel(rep.time_s)
        if trace.listening() and not _card.unbilled():
            trace.emit(trace.KernelRecord(self.index, start, rep))
        return rep

    # ---------------------------------------------------------- transfers
    def transfer_time(self, kind: str, nbytes: int, segments: int = 0) -> float:
        """``segments``: extra host segments the DMA gathers sticks from, one
        descriptor each (a folded layout packs host rows across sticks: a
        stick that a row boundary breaks is assembled from two pieces)."""
        cfg = self.config
        extra = segments * cfg.dma_setup_cycles / cfg.clock_hz
        if kind in ("h2d", "d2h"):
            # PCIe Gen5 x16, one direction: fixed latency + bytes at link rate
            return cfg.pcie_latency_s + nbytes / cfg.pcie_bandwidth_Bps + extra
        if kind == "d2d":
            # a DMA that reads and writes LPDDR5: both directions use its bandwidth
            return (
                cfg.dma_setup_cycles / cfg.clock_hz
                + 2 * nbytes / cfg.sustained_bandwidth_Bps
                + extra
            )
        raise ValueError(f"transfer kind must be one of {TRANSFER_KINDS}, got {kind!r}")

    def record_transfer(
        self, kind: str, nbytes: int, label: str = "", segments: int = 0
    ) -> trace.TransferRecord:
        self.check_stream()
        if nbytes < 0:
            raise ValueError(f"transfer of {nbytes} bytes")
        t = self.transfer_time(kind, int(nbytes), int(segments))
        start = self._clock.account_transfer(TRANSFER_KINDS.index(kind), int(nbytes), t)
        rec = trace.TransferRecord(self.index, kind, int(nbytes), start, t, label)
        if not _card.unbilled():
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
        start, _wait = self._clock.account_collective(int(nbytes), time_s, start_s)
        rec = trace.TransferRecord(self.index, "c2c", int(nbytes), start, time_s, op)
        trace.emit(rec)
        return rec

    # -------------------------------------------------------------- stats
    def stats(self) -> dict:
        """The clock and what ran: kernels, transfers by kind (h2d, d2h, d2d),
        card-to-card collectives (count, bytes, link time, and time spent
        waiting for the slowest card to arrive)."""
        return {"card": self.index, **self._clock.stats()}

    def reset(self) -> None:
        """Zero the clock and the counters (the config stays)."""
        self._clock.reset()


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
            config = _override or HardwareConfig.from_env()
            card = _cards[index] = SimulatedCard(index, config, _card.clock(index))
        return card


_override: HardwareConfig | None = None


def reset_cards(config: HardwareConfig | None = None) -> None:
    """Forget every card; the next ``get_card`` builds it from ``config`` or the environment.

    For tests and design studies.  The runtime must not hold device memory of
    the old cards when their capacity changes.
    """
    global _override
    with _cards_lock:
        for card in _cards.values():  # the new cards start their clocks at zero
            card.reset()
        _cards.clear()
        _override = config
    for fn in _on_reset:
        fn()
