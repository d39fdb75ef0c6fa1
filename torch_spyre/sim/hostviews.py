"""Host-layout views of device memory, kept for the functional executor.

Device memory holds the stick layout (the contract, and what the timing
model reads); the executor computes on host-layout tensors in the compute
dtype (fp32 for 16-bit floats).  Converting a whole operand on every launch
(re-lay + cast) costs more than the math for the weights of a model, which
are read on every token and never written.  So the executor keeps the
converted tensor of an operand it has read before, keyed by the device block
it came from, until something writes that block:

* every writer of device memory calls :func:`written` (the executor's stores,
  the runtime's copies, host fallbacks, re-linearisation): a stale view would
  be a wrong answer, and tests write through every writer and read back;
* a block's id is never reused (``_card.block_of``), so a view of a freed block
  cannot serve a new block at the same address; views of freed blocks are
  dropped when the budget needs room;
* admission on the second read: activations (read once or twice, then freed)
  mostly never enter, weights (read every step) do;
* a byte budget (default: as many host bytes as the cards hold in device
  memory, ``TORCH_SPYRE_HOST_VIEWS``), with no eviction of live entries to
  admit new ones: a model cycling over more weights than fit keeps a stable
  resident set instead of thrashing; under host memory pressure everything
  goes.

Numbers do not change: a view holds exactly the values a fresh conversion
would give, in the same host layout.

The weights of matmuls do not come here: they are read in place from their
stick layout (``sim/direct.py``), which keeps no host copy at all.  The views
serve the other operands read again and again (norm weights, rotary tables,
the weights of matmuls with ``TORCH_SPYRE_STICK_GEMM=0``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_spyre import _card, settings
from torch_spyre.layout import SpyreTensorLayout

#: operands smaller than this are converted on every read (cheap; not worth a slot)
MIN_BYTES = 64 << 10
#: below this fraction of MemAvailable / MemTotal the views are dropped
_PRESSURE_FRACTION = 0.10
_PRESSURE_EVERY_S = 1.0
#: misses to wait before trying to admit again into a full budget
_RETRY_MISSES = 1024

# (address) -> (block id, block base address), or (-1, 0) outside device memory;
# and the bytes of device memory in use.  Set by the runtime.
BlockOf = Callable[[int], tuple[int, int]]


@dataclass
class _Entry:
    host: torch.Tensor
    nbytes: int
    block: int


class HostViews:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple, _Entry] = {}
        #: block id -> (base address, keys of its views)
        self._by_block: dict[int, tuple[int, list[tuple]]] = {}
        self._seen: set[tuple] = set()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0
        #: the device memory this process simulates (the card module)
        self._block_of: BlockOf | None = _card.block_of
        self._device_bytes: Callable[[], int] | None = _device_bytes_in_use
        self._budget = _budget_from_env()
        self._pressure_checked = 0.0
        #: no admission attempt before this many misses (set when the budget is full)
        self._retry_after = 0

    # ------------------------------------------------------------ set-up
    def set_budget(self, budget: int | float | None) -> None:
        """Bytes (int), a multiple of the device bytes in use (float), or None (off)."""
        self._budget = budget
        self.clear()

    def budget_bytes(self) -> int:
        b = self._budget
        if b is None or self._device_bytes is None:
            return 0
        return int(b) if isinstance(b, int) else int(b * self._device_bytes())

    # ------------------------------------------------------------- reads
    def read(
        self,
        mem: torch.Tensor,
        layout: SpyreTensorLayout,
        dtype: torch.dtype,
        keep: bool,
        derive: tuple[tuple, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """``layout.to_host(mem, dtype)`` (then ``derive[1]`` of it, a tensor
        derived from it that ``derive[0]`` names), from a kept view when one is
        valid.

        The result must not be written by the caller.  ``keep``: the operand is
        only read by this program (a kept view of an operand the program also
        writes would be invalidated at once).
        """
        if not keep or layout.nbytes < MIN_BYTES or self._block_of is None or not self._budget:
            return _convert(mem, layout, dtype, derive)
        ptr = mem.data_ptr()
        block, base = self._block_of(ptr)
        if block < 0:
            return _convert(mem, layout, dtype, derive)
        key = (block, ptr - base, layout, dtype, derive[0] if derive else None)
        e = self._entries.get(key)
        if e is not None:
            self.hits += 1
            return e.host
        self.misses += 1
        host = _convert(mem, layout, dtype, derive)
        if key in self._seen:
            self._seen.discard(key)
            if self.misses >= self._retry_after:
                self._admit(key, host, block, base)
        else:
            if len(self._seen) > 65536:
                self._seen.clear()
            self._seen.add(key)
        return host

    def _admit(self, key: tuple, host: torch.Tensor, block: int, base: int) -> None:
        nbytes = host.numel() * host.element_size()
        with self._lock:
            budget = self.budget_bytes()
            if self.bytes + nbytes > budget:
                self._drop_dead()
            if self.bytes + nbytes > budget or self._under_pressure():
                # full: try again after a while, or once views are dropped
                self._retry_after = self.misses + _RETRY_MISSES
                return
            self._entries[key] = _Entry(host, nbytes, block)
            self._by_block.setdefault(block, (base, []))[1].append(key)
            self.bytes += nbytes

    def _drop_dead(self) -> None:
        """Forget the views of blocks that were freed."""
        block_of = self._block_of
        dead = [b for b, (base, _) in self._by_block.items() if block_of(base)[0] != b]
        for block in dead:
            self.evictions += len(self._by_block[block][1])
            self._drop_block(block)

    def _drop_block(self, block: int) -> None:
        self._retry_after = 0
        for key in self._by_block.pop(block, (0, ()))[1]:
            e = self._entries.pop(key, None)
            if e is not None:
                self.bytes -= e.nbytes

    def _under_pressure(self) -> bool:
        now = time.monotonic()
        if now - self._pressure_checked < _PRESSURE_EVERY_S:
            return False
        self._pressure_checked = now
        avail = _mem_available_fraction()
        if avail is not None and avail < _PRESSURE_FRACTION:
            self.evictions += len(self._entries)
            self._entries.clear()
            self._by_block.clear()
            self.bytes = 0
            return True
        return False

    # ------------------------------------------------------------ writes
    def written(self, mem: torch.Tensor) -> None:
        """Device memory ``mem`` (a CPU tensor aliasing it) was or will be written."""
        if not self._by_block or self._block_of is None or mem.numel() == 0:
            return
        block, _ = self._block_of(mem.data_ptr())
        if block in self._by_block:
            with self._lock:
                self.invalidations += len(self._by_block.get(block, (0, ()))[1])
                self._drop_block(block)

    def clear(self) -> None:
        with self._lock:
            self._retry_after = 0
            self._entries.clear()
            self._by_block.clear()
            self._seen.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes(),
            "entries": len(self._entries),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
        }


def _convert(mem, layout: SpyreTensorLayout, dtype: torch.dtype, derive) -> torch.Tensor:
    host = layout.to_host(mem, dtype)
    return host if derive is None else derive[1](host)


def _budget_from_env() -> int | float | None:
    """The ``host_views`` setting (``TORCH_SPYRE_HOST_VIEWS``): ``0``/``off``, a size (``2GiB``) or a multiple
    of the device bytes in use (``1.0x``); default ``1.0x``."""
    raw = settings.get().host_views.strip().lower()
    if raw in ("0", "off", "none", ""):
        return None
    if raw.endswith("x"):
        return float(raw[:-1])
    from torch_spyre.hardware import parse_size

    return int(parse_size(raw))


def _device_bytes_in_use() -> int:
    """Device memory held by live tensors on all cards, in bytes."""
    return sum(_card.mem_stats(i)["allocated_bytes"] for i in range(_card.num_cards()))


def _mem_available_fraction() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            info = {k: v for k, v in (line.split(":", 1) for line in f)}
        total = int(info["MemTotal"].split()[0])
        avail = int(info["MemAvailable"].split()[0])
        return avail / total if total else None
    except (OSError, KeyError, ValueError):
        return None


#: the views of this process's device memory (one address space for all cards)
VIEWS = HostViews()
