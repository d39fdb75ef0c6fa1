"""The host path of a ``spyre estimate`` (issue 18): every planned kernel of
prefill and one decode step on ``sim/hostpath.py``'s timeline, device-only
and end-to-end, and the per-kernel host cost that reproduces a published
end-to-end figure."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from torch_spyre.models.estimate_results import Estimate, Part

#: published end-to-end decode figures (shared/hardware.md): which host path
#: reproduces them is solved for, not assumed
PUBLISHED_DECODE: dict[str, dict[str, float]] = {
    "granite-3.3-8b": {
        "IBM's stack, mid 2026 (~865 ms/token)": 865e-3,
        "IBM's stack after the 2.4x decode speed-up (~360 ms/token)": 865e-3 / 2.4,
    }
}


def _kernel_seq(parts: list[Part]) -> list[float]:
    """Device seconds of every kernel of ``parts`` in issue order (a part's
    copies count as one more kernel)."""
    seq: list[float] = []
    for p in parts:
        ks = [t for _, t in p.kernels]
        rest = p.time_s - sum(ks)
        if rest > 1e-12:
            ks.append(rest)
        seq += ks * p.count
    return seq


def host_path(est: Estimate, cfg, published: dict[str, float] | None = None) -> dict[str, Any]:
    """Device-only and end-to-end timelines of ``est`` on the host path of
    ``cfg`` (sim/hostpath.py), and the per-kernel host cost that reproduces
    each ``published`` end-to-end decode time."""
    from torch_spyre.sim import hostpath

    def tl(kernel_s: list[float]) -> dict[str, Any]:
        t = hostpath.timeline(kernel_s, cfg)
        return {**asdict(t), "host_bound": t.host_bound}

    decode = _kernel_seq(est.decode)
    return {
        "assumed": {
            k: getattr(cfg, k)
            for k in ("host_dispatch_s", "host_descriptor_bytes", "host_sync_s", "host_async")
        },
        "prefill": tl(_kernel_seq(est.prefill)),
        "decode": tl(decode),
        "published": {
            name: {"target_s": t, "dispatch_s": hostpath.dispatch_for(decode, t, cfg)}
            for name, t in (published or {}).items()
        },
    }
