"""The hardware description of one simulated Spyre card.

Every field traces to ../shared/hardware.md ("published"), is derived from
published figures ("derived", arithmetic given), or is a modelling constant
that no public source states ("assumed" / "calibrated", with the reasoning).
docs/hardware-model.md tabulates them and shows what the calibration gives.

Users override any field for design studies:

* ``TORCH_SPYRE_HW_CONFIG=/path/cfg.json`` (or ``.toml``): a flat mapping of
  field names to values, e.g. ``{"cores": 16, "lx_bytes": "4MiB"}``;
* ``TORCH_SPYRE_HW_<FIELD>`` per field, e.g. ``TORCH_SPYRE_HW_CORES=16``,
  ``TORCH_SPYRE_HW_LX_BYTES=4MiB`` (environment beats the file);
* ``TORCH_SPYRE_DEVICE_MEMORY=64MiB``: alias of ``device_memory_bytes``;
* ``config.replace(cores=16)`` in code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass, fields
from typing import Any

import torch

from torch_spyre import settings

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: PE-array throughput relative to fp16.  int8 x2 and int4 x4 are derived in
#: hardware.md (int4 ~393 TOPS, consistent with "> 300 TOPS"); fp8 (e4m3 and
#: e5m2) is 8-bit data like int8, taken at the same x2 (derived: hardware.md
#: lists fp8 with int8 among the quantised types, and the 8-bit rate is a
#: property of the 8-bit datapath).  bf16 is taken at the fp16 rate (same
#: 16-bit datapath; assumed).  fp32 is not a PE-array type: modelled as 4 fp16
#: passes (assumed, no public figure).
PE_RATE_VS_FP16: dict[torch.dtype, float] = {
    torch.float16: 1.0,
    torch.bfloat16: 1.0,
    torch.int8: 2.0,
    torch.uint8: 2.0,
    torch.float8_e4m3fn: 2.0,
    torch.float8_e5m2: 2.0,
    torch.float32: 0.25,
}

#: 8-bit types the PE array consumes at its 8-bit rate (both operands 8-bit)
EIGHT_BIT: frozenset[torch.dtype] = frozenset(
    (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
)


def pe_rate(a: torch.dtype, b: torch.dtype | None = None) -> float:
    """PE throughput relative to fp16 of a matmul of ``a`` and ``b`` data.

    The 8-bit rate needs both operands 8-bit (W8A8: ``aten._scaled_mm``); a
    matmul of 16-bit activations with 8-bit weights dequantised in LX (W8A16)
    runs at the activations' rate.  Otherwise the rate of ``a`` (the left
    operand, the activation), as it always was.
    """
    if a in EIGHT_BIT:
        return 2.0 if b is None or b in EIGHT_BIT else 1.0
    return PE_RATE_VS_FP16.get(a, 0.25)


#: Vector-unit (SFU) cost classes: cycles per stick processed.  "simple"
#: (add, mul, max, compare, cast): one stick per cycle (assumed: the vector
#: unit is one stick wide).  "transcendental" (exp, log, tanh, rsqrt, div,
#: sigmoid...): calibrated, see ``sfu_transcendental_cycles``.  "reduction":
#: one input stick per cycle plus a cross-lane tree per output stick.
COST_CLASSES = ("simple", "transcendental", "reduction")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SUFFIX = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
}


class HardwareConfigError(ValueError):
    pass


def parse_size(value: Any) -> float:
    """``"4MiB"`` -> 4194304, ``"204.8GB"`` -> 2.048e11, ``16`` -> 16."""
    if isinstance(value, bool):
        raise HardwareConfigError(f"expected a number or size, got {value!r}")
    if isinstance(value, int | float):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _SUFFIX:
        raise HardwareConfigError(
            f"cannot parse {value!r} as a number or size (suffixes: KiB MiB GiB KB MB GB)"
        )
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


@dataclass(frozen=True)
class HardwareConfig:
    # ---------------------------------------------------------- published
    #: cores per card (published: hardware.md "cores per card").
    cores: int = 32
    #: corelets per core, sharing one LX (published: "core structure").
    corelets_per_core: int = 2
    #: PE array rows / columns per corelet (published: "8x8 SIMD-systolic").
    pe_rows: int = 8
    pe_cols: int = 8
    #: fp16 MACs per PE per cycle (derived: reproduces the published
    #: 98.304 TFLOP/s = 32 x 2 x 64 x 8 x 2 x 1.5e9).
    pe_lanes: int = 8
    #: core clock (derived with ``pe_lanes`` from the published peak).
    clock_hz: float = 1.5e9
    #: LX scratchpad per core (published: 2 MB SRAM; SRAM is binary-sized).
    lx_bytes: int = 2 * MiB
    #: stick, the LPDDR5 <-> LX transfer granule (published: BYTES_IN_STICK).
    stick_bytes: int = 128
    #: usable device memory (published: 128 GB LPDDR5, ~112 GB after ECC;
    #: 128 GiB x 7/8 in-band ECC = 112 GiB).
    device_memory_bytes: int = 112 * GiB
    #: peak LPDDR5 bandwidth of the card (published: 204.8 GB/s).
    memory_bandwidth_Bps: float = 204.8e9
    #: bi-directional ring, bytes per cycle per direction (published).
    ring_bytes_per_cycle: int = 128
    #: contiguous device memory a core can address (published: 256 MB).
    per_core_span_bytes: int = 256 * MiB
    #: PCIe Gen5 x16 per direction (derived: 32 GT/s x 16 lanes x 128/130
    #: line code / 8 bits = 63.0 GB/s; TLP overheads not modelled).
    pcie_bandwidth_Bps: float = 32e9 * 16 * 128 / 130 / 8
    # ----------------------------------------------- modelling constants
    #: sustained fraction of peak LPDDR5 bandwidth for streaming DMA
    #: (calibrated: the one published *measurement* of a large streaming
    #: kernel, GEMV [1,4096]x[4096,25600] fp16 = 209.7 MB in 1.76 ms on 25
    #: cores, is 119.2 GB/s = 0.582 of peak; typical LPDDR5 controllers
    #: sustain 55-80%).  Set 1.0 to model an ideal memory system.
    dram_efficiency: float = 0.582
    #: bytes per cycle one core's DMA engine moves (assumed: one stick per
    #: cycle, the width of the ring port the core sits on).
    dma_bytes_per_cycle: int = 128
    #: fixed cost of each DMA transfer (one tile load/store): descriptor
    #: issue plus first-access latency of LPDDR5 (~100 ns; assumed).
    dma_setup_cycles: int = 150
    #: latency of one ring hop (assumed: a few router pipeline stages).
    ring_hop_cycles: int = 4
    #: fixed cost of launching one kernel program on the card (assumed: a
    #: doorbell, descriptor fetch over PCIe and core start; ~2 PCIe round
    #: trips).
    launch_overhead_s: float = 2e-6
    #: host <-> device transfer fixed latency (assumed: one PCIe DMA round
    #: trip, ~1 us).
    pcie_latency_s: float = 1e-6
    #: vector-unit elements per cycle per corelet for 16-bit types (assumed:
    #: one stick per cycle; 32-bit types get half, one fp32 stick).
    vector_lanes: int = 64
    #: SFU cycles per stick for the "simple" cost class (assumed: 1).
    sfu_simple_cycles: float = 1.0
    #: SFU cycles per stick for transcendentals (exp, rsqrt, reciprocal,
    #: div...): calibrated, the one free constant fitted to the measured
    #: softmax 512x1024 fp16 on 1 core, LX-resident schedule (23.7 us ->
    #: 2 cycles gives 23.5 us; 1 gives 21 us, 3 gives 25.6 us).
    sfu_transcendental_cycles: float = 2.0
    #: card-to-card bandwidth per direction, per card (assumed: no public
    #: source names a card-to-card link; cards of one system are taken to
    #: exchange data peer-to-peer over their PCIe Gen5 x16 links through the
    #: system's PCIe switch at the link rate, full duplex, so a ring step
    #: sends and receives at once: 63.0 GB/s, the derived ``pcie_bandwidth_Bps``).
    c2c_bandwidth_Bps: float = 32e9 * 16 * 128 / 130 / 8
    #: fixed cost of one card-to-card step (assumed: a peer-to-peer DMA write
    #: plus the flag write the receiver polls, two PCIe one-way latencies of
    #: ~1 us each, as ``pcie_latency_s``).
    c2c_latency_s: float = 2e-6
    #: SFU cycles per input stick of a reduction (assumed: 1) ...
    sfu_reduction_cycles: float = 1.0
    #: ... plus this many per output element (cross-lane tree, log2(64)).
    sfu_reduction_tree_cycles: float = 6.0
    # ------------------------------------ host path (assumed: sim/hostpath.py)
    #: host CPU time to issue one kernel of a compiled graph (assumed: the
    #: wrapper's call, argument marshalling and the runtime's enqueue; no
    #: published figure for a lean runtime: 5 us; IBM's mid-2026 stack is
    #: reproduced by ~1 ms, see docs/models.md)
    host_dispatch_s: float = 5e-6
    #: bytes of descriptors / program per kernel written over PCIe (assumed)
    host_descriptor_bytes: int = 4096
    #: per generated token: the host waits for the token id and samples
    #: (assumed: one d2h round trip plus sampling, 20 us)
    host_sync_s: float = 20e-6
    #: 1: the host issues kernel i+1 while the card runs kernel i; 0: it waits
    #: for each kernel (a synchronous runtime)
    host_async: int = 1

    # ----------------------------------------------------------- checks
    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise HardwareConfigError(f"HardwareConfig.{f.name} must be an integer, got {v!r}")
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise HardwareConfigError(f"HardwareConfig.{f.name} must be a number, got {v!r}")
            zero_ok = f.name in {"dma_setup_cycles", "ring_hop_cycles", "launch_overhead_s"}
            zero_ok |= f.name in {"pcie_latency_s", "sfu_reduction_tree_cycles", "c2c_latency_s"}
            zero_ok |= f.name in {"host_dispatch_s", "host_descriptor_bytes", "host_sync_s"}
            zero_ok |= f.name == "host_async"
            if v < 0 or (v == 0 and not zero_ok):
                raise HardwareConfigError(f"HardwareConfig.{f.name} must be positive, got {v!r}")
        if self.dram_efficiency > 1:
            raise HardwareConfigError(
                f"HardwareConfig.dram_efficiency is a fraction of peak (0, 1], got {self.dram_efficiency}"
            )
        if self.stick_bytes % 16:
            raise HardwareConfigError("stick_bytes must hold whole int64/fp32/fp16 elements")

    # ------------------------------------------------------- derived
    @property
    def macs_per_cycle_per_core(self) -> int:
        """fp16 MACs per cycle of one core's PE arrays (all corelets)."""
        return self.corelets_per_core * self.pe_rows * self.pe_cols * self.pe_lanes

    def peak_flops(
        self,
        dtype: torch.dtype = torch.float16,
        cores: int | None = None,
        b_dtype: torch.dtype | None = None,
    ) -> float:
        """PE-array peak (2 FLOP per MAC) of ``cores`` cores (default: all), for
        ``dtype`` data (with ``b_dtype``, a matmul of the two: ``pe_rate``)."""
        n = self.cores if cores is None else cores
        rate = pe_rate(dtype, b_dtype)
        return 2.0 * self.macs_per_cycle_per_core * n * self.clock_hz * rate

    def vector_elems_per_cycle(self, dtype: torch.dtype = torch.float16) -> float:
        """Vector-unit elements per cycle per core at the "simple" rate."""
        itemsize = dtype.itemsize
        return self.corelets_per_core * self.vector_lanes * min(1.0, 2.0 / itemsize)

    def peak_vector_ops(self, dtype: torch.dtype = torch.float16) -> float:
        return (
            self.vector_elems_per_cycle(dtype) * self.cores * self.clock_hz / self.sfu_simple_cycles
        )

    @property
    def sustained_bandwidth_Bps(self) -> float:
        return self.memory_bandwidth_Bps * self.dram_efficiency

    def ridge_point(self, dtype: torch.dtype = torch.float16) -> float:
        """FLOP per byte where the card turns compute bound (fp16: 480)."""
        return self.peak_flops(dtype) / self.memory_bandwidth_Bps

    @property
    def cycle_s(self) -> float:
        return 1.0 / self.clock_hz

    @property
    def ring_bandwidth_Bps(self) -> float:
        return self.ring_bytes_per_cycle * self.clock_hz

    def sfu_cycles(self, cost_class: str) -> float:
        try:
            return {
                "simple": self.sfu_simple_cycles,
                "transcendental": self.sfu_transcendental_cycles,
                "reduction": self.sfu_reduction_cycles,
            }[cost_class]
        except KeyError:
            raise HardwareConfigError(
                f"unknown cost class {cost_class!r}; expected one of {COST_CLASSES}"
            ) from None

    # ---------------------------------------------------- construction
    def replace(self, **overrides: Any) -> HardwareConfig:
        """A copy with some fields changed (sizes may be strings: "4MiB")."""
        return dataclasses.replace(self, **_coerce(overrides))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(values: dict[str, Any]) -> HardwareConfig:
        return HardwareConfig().replace(**values)

    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> HardwareConfig:
        return HardwareConfig().replace(**_read_file(str(path)))

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> HardwareConfig:
        """The process's settings' card (``settings.get()``), or the card an
        environment describes: defaults, then ``TORCH_SPYRE_HW_CONFIG``, then
        ``TORCH_SPYRE_DEVICE_MEMORY`` and the per-field variables."""
        s = settings.get() if environ is None else settings.Settings.from_env(environ)
        return HardwareConfig.from_settings(s)

    @staticmethod
    def from_settings(s: settings.Settings) -> HardwareConfig:
        """The card ``s`` describes (its ``hw_config`` file, ``device_memory``, ``hw`` fields)."""
        overrides: dict[str, Any] = {}
        if s.hw_config:
            overrides.update(_read_file(s.hw_config))
        if s.device_memory:
            overrides["device_memory_bytes"] = s.device_memory
        names = {f.name.upper(): f.name for f in fields(HardwareConfig)}
        for key, value in s.hw.items():
            field = names.get(key.upper())
            if field is None:
                raise HardwareConfigError(
                    f"TORCH_SPYRE_HW_{key.upper()} names no HardwareConfig field; known: "
                    + ", ".join(f"TORCH_SPYRE_HW_{n}" for n in sorted(names))
                )
            overrides[field] = value
        return HardwareConfig().replace(**overrides)


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    types = {f.name: f.type for f in fields(HardwareConfig)}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in types:
            raise HardwareConfigError(
                f"HardwareConfig has no field {name!r}; fields: {', '.join(types)}"
            )
        try:
            v = parse_size(value)
        except HardwareConfigError as e:
            raise HardwareConfigError(f"HardwareConfig.{name}: {e}") from None
        if types[name] == "int":
            if float(v) != int(v):
                raise HardwareConfigError(
                    f"HardwareConfig.{name} must be a whole number, got {value!r}"
                )
            v = int(v)
        else:
            v = float(v)
        out[name] = v
    return out


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f) if path.endswith(".toml") else json.load(f)
    except (OSError, ValueError) as e:
        raise HardwareConfigError(f"cannot read hardware config {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise HardwareConfigError(f"hardware config {path!r} must be a mapping of field names")
    return data
