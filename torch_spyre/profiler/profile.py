"""The ``profile()`` context manager and its views (table, Chrome trace, roofline)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from torch_spyre.hardware import HardwareConfig
from torch_spyre.runtime import dispatch_stats
from torch_spyre.sim import KernelRecord, KernelReport, TransferRecord, trace
from torch_spyre.sim.trace import Record


@dataclass(frozen=True)
class KernelEntry:
    name: str
    card: int
    start_s: float
    time_s: float
    utilisation: float
    bottleneck: str
    cores_used: int
    attainment: float
    report: KernelReport


class Profile:
    def __init__(self, config: HardwareConfig | None = None) -> None:
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._config = config
        self._degraded_before: dict[str, int] = {}
        #: nodes of compiled graphs that ran as eager ops inside this profile,
        #: by buffer name (the compiler could not plan them: compiler/degrade.py)
        self.degraded: dict[str, int] = {}

    # -------------------------------------------------------- collecting
    def _on_record(self, rec: Record) -> None:
        with self._lock:
            self.records.append(rec)

    def __enter__(self) -> Profile:
        self._degraded_before = dict(dispatch_stats.counts("degraded"))
        trace.add_listener(self._on_record)
        return self

    def __exit__(self, *exc: Any) -> None:
        trace.remove_listener(self._on_record)
        now = dispatch_stats.counts("degraded")
        self.degraded = {
            k: n - self._degraded_before.get(k, 0)
            for k, n in now.items()
            if n > self._degraded_before.get(k, 0)
        }

    # ------------------------------------------------------------ views
    @property
    def kernels(self) -> list[KernelEntry]:
        return [
            KernelEntry(
                r.report.name,
                r.card,
                r.start_s,
                r.report.time_s,
                r.report.utilisation,
                r.report.bottleneck,
                r.report.cores_used,
                r.report.attainment,
                r.report,
            )
            for r in self.records
            if isinstance(r, KernelRecord)
        ]

    @property
    def transfers(self) -> list[TransferRecord]:
        return [r for r in self.records if isinstance(r, TransferRecord)]

    @property
    def fallbacks(self) -> dict[str, float]:
        """Ops that ran on the host, with the modelled time of their copies."""
        out: dict[str, float] = {}
        for t in self.transfers:
            if t.label.startswith("fallback "):
                op = t.label.removeprefix("fallback ")
                out[op] = out.get(op, 0.0) + t.time_s
        return out

    @property
    def kernel_time_s(self) -> float:
        return sum(k.time_s for k in self.kernels)

    @property
    def transfer_time_s(self) -> float:
        return sum(t.time_s for t in self.transfers)

    @property
    def total_time_s(self) -> float:
        """Modelled time of everything collected (cards run one record at a time)."""
        return self.kernel_time_s + self.transfer_time_s

    def _host_config(self) -> HardwareConfig:
        return self._config or HardwareConfig.from_env()

    def host_timeline(self, card: int | None = None):
        """The profiled kernels (of ``card``; default: all) on the host path's
        timeline (``sim/hostpath.py``, assumed host costs): device-only and
        end-to-end time, the host's issue work."""
        from torch_spyre.sim import hostpath

        ks = [k.time_s for k in self.kernels if card is None or k.card == card]
        return hostpath.timeline(ks, self._host_config(), sync=False)

    def table(self, sort_by: str = "time", explain: bool = False) -> str:
        """Kernels grouped by name, then transfers by kind, as a text table;
        ``explain``: each kernel's planned core grid and tiles too
        (``sim.timing.plan_text``)."""
        groups: dict[str, list[KernelEntry]] = {}
        for k in self.kernels:
            groups.setdefault(k.name, []).append(k)
        rows = []
        for name, ks in groups.items():
            total = sum(k.time_s for k in ks)
            r = ks[0].report
            rows.append(
                (
                    name,
                    len(ks),
                    total,
                    total / len(ks),
                    r.cores_used,
                    r.utilisation,
                    r.bottleneck,
                    r.attainment,
                    r.plan,
                )
            )
        if sort_by == "time":
            rows.sort(key=lambda x: -x[2])
        head = f"{'kernel':<34} {'calls':>5} {'total us':>11} {'avg us':>10} {'cores':>5} {'util':>6} {'bound':>9} {'roofline':>8}"
        if explain:
            head += "  plan"
        lines = [head, "-" * len(head)]
        for name, n, total, avg, cores, util, bound, att, plan in rows:
            lines.append(
                f"{name[:34]:<34} {n:>5} {total * 1e6:>11.2f} {avg * 1e6:>10.2f} {cores:>5} "
                f"{util:>6.0%} {bound:>9} {att:>8.0%}" + (f"  {plan}" if explain else "")
            )
        kinds: dict[str, list[TransferRecord]] = {}
        for t in self.transfers:
            kinds.setdefault(t.kind, []).append(t)
        if kinds:
            lines.append("")
            lines.append(f"{'transfer':<10} {'count':>6} {'MB':>12} {'total us':>11} {'GB/s':>8}")
            for kind, ts in sorted(kinds.items()):
                nb = sum(t.nbytes for t in ts)
                tt = sum(t.time_s for t in ts)
                lines.append(
                    f"{kind:<10} {len(ts):>6} {nb / 1e6:>12.3f} {tt * 1e6:>11.2f} "
                    f"{(nb / tt / 1e9 if tt else 0):>8.2f}"
                )
        fallbacks: dict[str, list[TransferRecord]] = {}
        for t in self.transfers:
            if t.label.startswith("fallback "):
                fallbacks.setdefault(t.label.removeprefix("fallback "), []).append(t)
        if fallbacks:
            lines.append("")
            lines.append(
                f"{'host fallback (op ran on the host)':<44} {'copies':>6} {'total us':>11}"
            )
            for op, ts in sorted(fallbacks.items(), key=lambda kv: -sum(t.time_s for t in kv[1])):
                lines.append(f"{op[:44]:<44} {len(ts):>6} {sum(t.time_s for t in ts) * 1e6:>11.2f}")
        if self.degraded:
            lines.append("")
            lines.append(
                f"{'compiled-graph nodes run as eager kernels':<44} {'runs':>6}"
                "  (not planned: see the compile log)"
            )
            for node, n in sorted(self.degraded.items()):
                lines.append(f"{node[:44]:<44} {n:>6}")
        lines.append("")
        lines.append(
            f"total modelled time {self.total_time_s * 1e6:.2f} us "
            f"(kernels {self.kernel_time_s * 1e6:.2f} us, transfers {self.transfer_time_s * 1e6:.2f} us)"
        )
        if self.kernels:
            h = self.host_timeline()
            lines.append(
                f"host path (assumed costs, sim/hostpath.py): issue {h.kernels} kernels "
                f"{h.host_issue_s * 1e6:.2f} us; kernels end to end {h.end_to_end_s * 1e6:.2f} us "
                f"vs device-only {h.device_s * 1e6:.2f} us "
                f"({'host' if h.host_bound else 'device'} bound)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ----------------------------------------------------- chrome trace
    def chrome_trace(self) -> dict[str, Any]:
        """Trace events: one process per card, one thread (track) per core + transfers."""
        events: list[dict[str, Any]] = []
        cards = sorted({r.card for r in self.records})
        for card in cards:
            events.append(_meta("process_name", card, 0, {"name": f"spyre:{card} (simulated)"}))
        named: set[tuple[int, int]] = set()

        def track(card: int, tid: int, name: str) -> None:
            if (card, tid) not in named:
                named.add((card, tid))
                events.append(_meta("thread_name", card, tid, {"name": name}))
                events.append(_meta("thread_sort_index", card, tid, {"sort_index": tid}))

        for r in self.records:
            if isinstance(r, TransferRecord):
                track(r.card, 0, "transfers")
                events.append(
                    {
                        "name": f"{r.kind} {r.label}" if r.label else r.kind,
                        "cat": "fallback" if r.label.startswith("fallback ") else "transfer",
                        "ph": "X",
                        "pid": r.card,
                        "tid": 0,
                        "ts": r.start_s * 1e6,
                        "dur": r.time_s * 1e6,
                        "args": {"bytes": r.nbytes, "GB/s": r.bandwidth_Bps / 1e9},
                    }
                )
                continue
            rep = r.report
            launch = rep.launch_s
            for core in range(rep.cores_used):
                track(r.card, core + 1, f"core {core}")
                args = {u: f"{rep.busy_s[u][core] * 1e6:.3f} us" for u in rep.busy_s}
                args.update(bottleneck=rep.bottleneck, kernel_us=rep.time_s * 1e6)
                events.append(
                    {
                        "name": rep.name,
                        "cat": "kernel",
                        "ph": "X",
                        "pid": r.card,
                        "tid": core + 1,
                        "ts": (r.start_s + launch) * 1e6,
                        "dur": rep.core_time_s[core] * 1e6,
                        "args": args,
                    }
                )
        self._host_track(events)
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def _host_track(self, events: list[dict[str, Any]]) -> None:
        """Per card, a "host issue" track: each kernel's modelled issue on the
        host (sim/hostpath.py), asynchronous, from the card's first kernel
        on; where the issue lands after the kernel's device start, the card
        would have waited that long (args ``card_waits_us``)."""
        from torch_spyre.sim import hostpath

        cfg = self._host_config()
        per = hostpath.issue_cost(cfg)
        by_card: dict[int, list[KernelRecord]] = {}
        for r in self.records:
            if isinstance(r, KernelRecord):
                by_card.setdefault(r.card, []).append(r)
        for card, recs in by_card.items():
            tid = HOST_TID
            events.append(_meta("thread_name", card, tid, {"name": "host issue (modelled)"}))
            events.append(_meta("thread_sort_index", card, tid, {"sort_index": -1}))
            host = max(0.0, recs[0].start_s - per - cfg.pcie_latency_s)
            for r in recs:
                ready = host + per + cfg.pcie_latency_s
                events.append(
                    {
                        "name": f"issue {r.report.name}",
                        "cat": "host",
                        "ph": "X",
                        "pid": card,
                        "tid": tid,
                        "ts": host * 1e6,
                        "dur": per * 1e6,
                        "args": {"card_waits_us": max(0.0, ready - r.start_s) * 1e6},
                    }
                )
                host += per

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    # -------------------------------------------------------- roofline
    def roofline_plot(self, path: str, config: HardwareConfig | None = None) -> None:
        """PNG of each kernel (attained FLOP/s vs arithmetic intensity) under the card's roofs."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "roofline_plot needs matplotlib: pip install matplotlib "
                "(or pip install 'torch-spyre[plots]')"
            ) from e
        cfg = config or self._config or HardwareConfig()
        peak = cfg.peak_flops()
        bw = cfg.memory_bandwidth_Bps
        fig, ax = plt.subplots(figsize=(7, 5))
        xs = [2.0**i for i in range(-4, 15)]
        ax.plot(xs, [min(peak, x * bw) for x in xs], "k-", label="card roof (peak)")
        ax.plot(
            xs,
            [min(peak, x * cfg.sustained_bandwidth_Bps) for x in xs],
            "k--",
            label=f"sustained memory ({cfg.dram_efficiency:.0%})",
        )
        ax.axhline(
            cfg.peak_vector_ops(), color="grey", ls=":", label="vector-unit peak (simple ops)"
        )
        markers = "osD^v<>ph*"
        seen: set[str] = set()
        for k in self.kernels:
            r = k.report
            if k.name in seen:
                continue
            seen.add(k.name)
            # vector work counts as operations for kernels without matmuls
            work = r.flops or r.vector_ops
            ai = max(work / max(r.compulsory_bytes, 1), 2.0**-4)
            marker = markers[len(seen) % len(markers)]
            ax.scatter([ai], [max(work / r.time_s, 1.0)], marker=marker, label=k.name[:30])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP per byte of device memory)")
        ax.set_ylabel("attained FLOP/s (modelled)")
        ax.set_title(f"Spyre roofline: {cfg.cores} cores, ridge {cfg.ridge_point():.0f} FLOP/B")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


#: the chrome trace's track of the modelled host issue, per card
HOST_TID = 100000


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def profile(config: HardwareConfig | None = None) -> Profile:
    """A context manager collecting every spyre kernel and transfer inside it."""
    return Profile(config)
