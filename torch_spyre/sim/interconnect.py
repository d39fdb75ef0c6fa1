"""Modelled time of collectives between the cards of one system.

Path (assumed, docs/hardware-model.md): every card has one PCIe Gen5 x16 link
to the system's switch; cards exchange data peer-to-peer over it, full duplex,
at ``HardwareConfig.c2c_bandwidth_Bps`` per direction, with a fixed cost of
``c2c_latency_s`` per step.  Collectives use the ring algorithm: with ``n``
cards, a ring step moves ``1/n`` of the data from every card to its
neighbour at once, so the busiest link carries the bandwidth term below.

=================  ===============================================  ==========
collective          time (B: bytes as defined)                       B is
=================  ===============================================  ==========
all_reduce          2(n-1)/n * B / bw + 2(n-1) * lat                 the tensor
all_gather          (n-1)/n * B / bw + (n-1) * lat                   the output
reduce_scatter      (n-1)/n * B / bw + (n-1) * lat                   the input
gather              (n-1)/n * B / bw + (n-1) * lat                   the output
broadcast           B / bw + (n-1) * lat   (pipelined chain)         the tensor
barrier             2(n-1) * lat           (all_reduce of nothing)   --
send / recv         B / bw + lat                                     the tensor
=================  ===============================================  ==========

One card (n = 1) costs nothing.  The reduction arithmetic is not added: the
vector units reduce a stick per cycle per corelet, far above the link rate,
and overlap the next ring step.  Bytes are whole sticks of device memory.
"""

from __future__ import annotations

from torch_spyre.hardware import HardwareConfig

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "broadcast",
    "barrier",
    "send",
    "recv",
)


def collective_time(op: str, nbytes: int, n: int, config: HardwareConfig) -> float:
    """Modelled seconds of collective ``op`` over ``n`` cards moving ``nbytes``."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; modelled: {', '.join(COLLECTIVES)}")
    if n < 1:
        raise ValueError(f"a collective needs at least one card, got n={n}")
    if nbytes < 0:
        raise ValueError(f"a collective of {nbytes} bytes")
    bw, lat = config.c2c_bandwidth_Bps, config.c2c_latency_s
    if op in ("send", "recv"):
        return nbytes / bw + lat
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    if op in ("all_gather", "reduce_scatter", "gather"):
        return (n - 1) / n * nbytes / bw + (n - 1) * lat
    if op == "broadcast":
        return nbytes / bw + (n - 1) * lat
    return 2 * (n - 1) * lat  # barrier
