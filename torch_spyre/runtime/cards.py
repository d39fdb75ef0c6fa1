"""The cards of this process: how many, their hardware configuration, and the
simulated card object behind each device index.

The runtime talks to cards only through this module, so a real-card runtime
could replace the simulator here.
"""

from __future__ import annotations

from torch_spyre import _C, _card, settings
from torch_spyre.hardware import HardwareConfig
from torch_spyre.sim import SimulatedCard, get_card, timing_only_active, trace
from torch_spyre.sim import card as sim_card

MAX_CARDS = 8


def configured_num_cards() -> int:
    """The ``num_cards`` setting: TORCH_SPYRE_NUM_CARDS, else AIU_WORLD_SIZE (the
    cards IBM's runtime makes visible; torch_spyre.compat exports it back, so
    the two always agree), else 1."""
    return settings.get().num_cards


def init() -> None:
    """Tell the card module how many cards there are and how much each holds."""
    n = configured_num_cards()
    _card.set_cards(n, [card(i).config.device_memory_bytes for i in range(n)])
    sim_card.on_reset(_C._warm_clear)  # its entries hold the old cards' modelled times
    sim_card.watch(_update_warm_path)
    settings.watch(_update_warm_path)
    _update_warm_path()


def on_reset(fn) -> None:
    """Call ``fn()`` after the cards are rebuilt (``sim.reset_cards``: a new
    hardware config): caches of modelled times must go."""
    sim_card.on_reset(fn)


def warm_path(on: bool | None = None) -> bool:
    """Whether eager ``add``/``sub``/``mul``/``div`` calls the Python path has
    launched before may be served by the C++ warm path; ``on`` sets it.
    Returns the setting before the call.  The figures are the same either way
    (values, modelled clock, counters); off is for comparisons and debugging.
    The ``warm_path`` setting (``TORCH_SPYRE_WARM_PATH``)."""
    before = settings.get().warm_path
    if on is not None:
        settings.update(warm_path=bool(on))  # _update_warm_path watches the settings
    return before


def _update_warm_path(*_: object) -> None:
    # the warm path emits no trace records and always executes: it stands
    # aside while anyone listens and in timing-only runs
    # (nor while a card's stream is in error: it would not refuse the launch)
    on = settings.get().warm_path and not timing_only_active() and not trace.listening()
    on = on and not any(_card.stream_error(i) for i in range(_card.num_cards()))
    _C._warm_allow(on)


def device_bytes_in_use() -> int:
    """Device memory held by live tensors on all cards, in bytes."""
    return sum(memory_stats(i)["allocated_bytes"] for i in range(num_cards()))


def memory_stats(index: int) -> dict[str, int]:
    """Card ``index``'s device memory: allocated, peak, capacity, counts."""
    return _card.mem_stats(index)


def reset_peak_memory(index: int) -> None:
    _card.reset_peak(index)


def num_cards() -> int:
    return _card.num_cards()


def card(index: int) -> SimulatedCard:
    return get_card(index)


def config(index: int = 0) -> HardwareConfig:
    return card(index).config


def record_transfer(index: int, kind: str, nbytes: int, label: str = "", segments: int = 0) -> None:
    """Model a copy (h2d / d2h over PCIe, d2d in device memory) on card `index`
    (``segments``: extra host pieces its sticks are gathered from)."""
    card(index).record_transfer(kind, nbytes, label, segments)


def record_collective(
    index: int, op: str, nbytes: int, time_s: float, start_s: float | None = None
) -> float:
    """Model a collective on card ``index`` (its clock waits until ``start_s``, then
    ``time_s``); returns by how much the clock moved."""
    c = card(index)
    before = c.clock_s
    c.record_collective(op, nbytes, time_s, start_s)
    return c.clock_s - before


# ------------------------------------------------------------ stream errors
def stream_error(index: int) -> str:
    """What put card ``index``'s stream into error ("" when healthy)."""
    return card(index).stream_error()


def clear_stream_error(index: int | None = None) -> None:
    """Reset card ``index`` (every card for None) out of its stream error."""
    for i in range(num_cards()) if index is None else [index]:
        card(i).clear_stream_error()
