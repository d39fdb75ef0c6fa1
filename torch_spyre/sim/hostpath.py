"""The host path: what it costs the host to keep the card busy (issue 18).

Device time (``sim.timing``) says how long the card computes.  A real
forward also pays, per kernel, the host's issue work and a PCIe write of
the kernel's descriptors and doorbell, and per generated token a wait for
the token id.  With an asynchronous runtime the host issues kernel i+1 while
the card runs kernel i, so the slower of the two streams sets the pace; a
synchronous one adds them.  All of it is assumed (no published breakdown of
IBM's host path): the parameters are ``HardwareConfig.host_*`` plus the
PCIe figures already there, and ``dispatch_for`` solves which per-kernel
host cost reproduces a published end-to-end figure.

One timeline, per kernel in issue order::

    host  += host_dispatch_s + host_descriptor_bytes / pcie_bandwidth
    ready  = host + pcie_latency_s                     (the doorbell lands)
    device = max(device, ready) + kernel time
    (synchronous runtime: host = device after every kernel)

and once per token ``host_sync_s`` after the last kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch_spyre.hardware import HardwareConfig


@dataclass(frozen=True)
class Timeline:
    """One forward (or decode step) on the host path's timeline."""

    device_s: float  # the kernels' device time alone (the device-only figure)
    host_issue_s: float  # the host's issue work for every kernel
    end_to_end_s: float  # first issue to the result on the host
    kernels: int

    @property
    def host_bound(self) -> bool:
        return self.host_issue_s > self.device_s

    @property
    def idle_s(self) -> float:
        """Time the card waits for the host."""
        return self.end_to_end_s - self.device_s


def issue_cost(cfg: HardwareConfig) -> float:
    """Host seconds to issue one kernel: dispatch plus its descriptors over PCIe."""
    return cfg.host_dispatch_s + cfg.host_descriptor_bytes / cfg.pcie_bandwidth_Bps


def timeline(kernel_s: Sequence[float], cfg: HardwareConfig, *, sync: bool = True) -> Timeline:
    """The timeline of ``kernel_s`` (device seconds of each kernel, in issue
    order); ``sync``: the host waits for the result at the end (a decode step)."""
    per = issue_cost(cfg)
    host = dev = 0.0
    for t in kernel_s:
        host += per
        dev = max(dev, host + cfg.pcie_latency_s) + t
        if not cfg.host_async:
            host = dev
    end = dev + (cfg.host_sync_s if sync else 0.0)
    return Timeline(float(sum(kernel_s)), per * len(kernel_s), end, len(kernel_s))


def dispatch_for(kernel_s: Sequence[float], target_s: float, cfg: HardwareConfig) -> float | None:
    """The ``host_dispatch_s`` at which ``timeline(kernel_s)`` takes ``target_s``
    (bisection; the end-to-end time grows with it), or None when even a free
    host path is slower than ``target_s``."""
    lo, hi = 0.0, 1.0
    if timeline(kernel_s, cfg.replace(host_dispatch_s=lo)).end_to_end_s > target_s:
        return None
    for _ in range(80):
        mid = (lo + hi) / 2
        if timeline(kernel_s, cfg.replace(host_dispatch_s=mid)).end_to_end_s < target_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
