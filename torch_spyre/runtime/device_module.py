"""``torch.spyre``: the names a CUDA user expects, for the spyre cards."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from torch_spyre import _C
from torch_spyre.runtime import cards

DeviceLike = torch.device | str | int | None


def _index(device: DeviceLike = None) -> int:
    if device is None:
        return _C._get_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "spyre":
        raise ValueError(f"expected a spyre device, got {device}")
    return device.index if device.index is not None else _C._get_device()


def _checked(device: DeviceLike = None) -> int:
    idx = _index(device)
    if not 0 <= idx < device_count():
        raise RuntimeError(
            f"spyre:{idx} does not exist: this process has {device_count()} spyre card(s) "
            f"(set TORCH_SPYRE_NUM_CARDS before importing torch_spyre)"
        )
    return idx


# ------------------------------------------------------------------ devices
def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    """Whether the cards have been used: a tensor allocated or a kernel or copy
    run on one.  Importing torch_spyre sets the cards up (cheaply: there is no
    driver to start), but, as torch.cuda's, this stays False until then."""
    for i in range(cards.num_cards()):
        if cards.memory_stats(i)["num_allocs"] or cards.card(i).clock_s:
            return True
    return False


def _is_in_bad_fork() -> bool:
    """The simulated card has no driver state that a fork could corrupt."""
    return False


def _lazy_init() -> None:
    """Cards are initialised at import; kept for code written against torch.cuda."""


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return _C._get_device()


def set_device(device: DeviceLike) -> None:
    _C._set_device(_checked(device))


class device:
    """Context manager that makes ``device`` the current spyre card."""

    def __init__(self, device: DeviceLike):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        set_device(self.idx)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_device(self.prev)


def synchronize(device: DeviceLike = None) -> None:
    """Kernels run to completion when launched on the simulated card."""
    _checked(device)


def get_device_name(device: DeviceLike = None) -> str:
    return get_device_properties(device).name


@dataclass(frozen=True)
class SpyreDeviceProperties:
    name: str
    index: int
    cores: int
    corelets_per_core: int
    lx_bytes: int
    total_memory: int
    memory_bandwidth_Bps: float
    ring_bytes_per_cycle: int
    clock_hz: float
    peak_fp16_flops: float
    pcie_bandwidth_Bps: float

    @property
    def multi_processor_count(self) -> int:  # the torch.cuda spelling
        return self.cores


def get_device_properties(device: DeviceLike = None) -> SpyreDeviceProperties:
    idx = _checked(device)
    cfg = cards.config(idx)
    return SpyreDeviceProperties(
        name="IBM Spyre (simulated)",
        index=idx,
        cores=cfg.cores,
        corelets_per_core=cfg.corelets_per_core,
        lx_bytes=cfg.lx_bytes,
        total_memory=cfg.device_memory_bytes,
        memory_bandwidth_Bps=cfg.memory_bandwidth_Bps,
        ring_bytes_per_cycle=cfg.ring_bytes_per_cycle,
        clock_hz=cfg.clock_hz,
        peak_fp16_flops=cfg.peak_flops(torch.float16),
        pcie_bandwidth_Bps=cfg.pcie_bandwidth_Bps,
    )


# ---------------------------------------------------------------------- AMP
def get_amp_supported_dtype() -> list[torch.dtype]:
    """What torch.autocast("spyre") may cast to: the card computes in fp16
    (IBM's DL16 slot); bf16 is stored and computed through fp32."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


# ---------------------------------------------------------------------- RNG
class _DefaultGenerators:
    def __getitem__(self, idx: int) -> torch.Generator:
        return _default_generators()[idx]

    def __len__(self) -> int:
        return device_count()

    def __iter__(self):
        return iter(_default_generators())


_generators: tuple[torch.Generator, ...] = ()


def _default_generators() -> tuple[torch.Generator, ...]:
    global _generators
    if len(_generators) != device_count():  # the card count is fixed at import
        _generators = tuple(_C._default_generator(i) for i in range(device_count()))
    return _generators


default_generators = _DefaultGenerators()


def manual_seed(seed: int) -> None:
    default_generators[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    default_generators[current_device()].seed()


def seed_all() -> None:
    for g in default_generators:
        g.seed()


def initial_seed() -> int:
    return default_generators[current_device()].initial_seed()


def get_rng_state(device: DeviceLike = None) -> torch.Tensor:
    return default_generators[_checked(device)].get_state()


def set_rng_state(state: torch.Tensor, device: DeviceLike = None) -> None:
    default_generators[_checked(device)].set_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators]


def set_rng_state_all(states) -> None:
    for g, s in zip(default_generators, states):
        g.set_state(s)


# ------------------------------------------------------------- card state
def stream_error(device: DeviceLike = None) -> str:
    """What put the card's stream into error ("" when it is healthy): a kernel
    that failed while it ran on the card.  The card then refuses every launch
    and transfer until ``reset_device_state``."""
    return cards.stream_error(_checked(device))


def reset_device_state(device: DeviceLike = None) -> None:
    """Reset the card (every card when ``device`` is None) out of a stream
    error; its memory and tensors are kept.  The equivalent of restarting
    IBM's runtime after ``SpyreDeviceState.StreamError``."""
    cards.clear_stream_error(None if device is None else _checked(device))


# ------------------------------------------------------------------ streams
class Stream(torch.Stream):
    """A stream on a spyre card.

    The simulated card runs every kernel to completion at launch, so streams
    order nothing; they exist so stream-aware code runs unchanged.
    """

    def __new__(cls, device: DeviceLike = None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        return super().__new__(
            cls, device=torch.device("spyre", _checked(device)), priority=priority
        )


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
    """An event on the current spyre card; ``elapsed_time`` is *modelled* device time (ms).

    A factory rather than a subclass: torch.Event.elapsed_time accepts only
    exact torch.Event objects.
    """
    return torch.Event(
        device=torch.device("spyre", current_device()),
        enable_timing=enable_timing,
        blocking=blocking,
        interprocess=interprocess,
    )


def _as_spyre_stream(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: DeviceLike = None) -> Stream:
    return _as_spyre_stream(
        torch.accelerator.current_stream(torch.device("spyre", _checked(device)))
    )


def default_stream(device: DeviceLike = None) -> Stream:
    current = torch.accelerator.current_stream(torch.device("spyre", _checked(device)))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None):
    if stream is None:
        yield
        return
    prev = current_stream(stream.device)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(prev)


# ------------------------------------------------------------------- memory
def memory_allocated(device: DeviceLike = None) -> int:
    """Device memory held by live tensors, in bytes (whole sticks)."""
    return cards.memory_stats(_checked(device))["allocated_bytes"]


def max_memory_allocated(device: DeviceLike = None) -> int:
    return cards.memory_stats(_checked(device))["peak_allocated_bytes"]


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    cards.reset_peak_memory(_checked(device))


def reset_max_memory_allocated(device: DeviceLike = None) -> None:
    reset_peak_memory_stats(device)


def memory_reserved(device: DeviceLike = None) -> int:
    """No caching allocator: reserved is what is allocated."""
    return memory_allocated(device)


def max_memory_reserved(device: DeviceLike = None) -> int:
    return max_memory_allocated(device)


def empty_cache() -> None:
    """Freed device memory returns to the card at once; this drops the
    simulator's host-side views of device memory (host RAM, not device memory)."""
    from torch_spyre.sim.hostviews import VIEWS

    VIEWS.clear()


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    s = cards.memory_stats(_checked(device))
    return s["capacity_bytes"] - s["allocated_bytes"], s["capacity_bytes"]


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    """Counters in torch.cuda.memory_stats' naming, plus the card's capacity."""
    idx = _checked(device)
    s = cards.memory_stats(idx)
    card = cards.card(idx).stats()
    out = {
        "allocated_bytes.all.current": s["allocated_bytes"],
        "allocated_bytes.all.peak": s["peak_allocated_bytes"],
        "allocation.all.current": s["live_blocks"],
        "allocation.all.allocated": s["num_allocs"],
        "allocation.all.freed": s["num_frees"],
        "reserved_bytes.all.current": s["allocated_bytes"],
        "num_ooms": s["num_ooms"],
        "capacity_bytes": s["capacity_bytes"],
    }
    for key, value in card.items():
        if isinstance(value, int | float):
            out[f"card.{key}"] = value
    return out


def memory_summary(device: DeviceLike = None) -> str:
    stats = memory_stats(device)
    width = max(len(k) for k in stats)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in stats.items())


def modelled_time_s(device: DeviceLike = None) -> float:
    """The card's modelled clock: kernel and transfer time so far, in seconds."""
    return cards.card(_checked(device)).clock_s
