"""Modelled device time per engine step: a log line and Prometheus metrics.

The metrics live in the process that runs the worker (vLLM's engine core):

* ``spyre:step_modelled_seconds`` (histogram): modelled card time of each step
  (forward + LM head + the step's host<->device copies);
* ``spyre:modelled_device_seconds_total`` (counter) and ``spyre:steps_total``;
* ``spyre:op_calls{path=kernel|adapter|fallback|degraded}`` (gauge): the
  worker's op calls so far by how they were served (``runtime.dispatch_stats``,
  updated each step): ``path="fallback"`` counts calls that ran on the host.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` that is the API server's process and
they appear on its ``/metrics``.  With the default separate engine process the
worker serves them on ``TORCH_SPYRE_VLLM_METRICS_PORT`` (picked free by the API
server process when unset) and the API server's ``/metrics`` includes them
through a collector that reads that port on each scrape (one scrape target for
llm-d).  ``TORCH_SPYRE_VLLM_LOG_STEPS=N`` logs every N-th step (default 1, 0 = never).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm.logger import init_logger

from torch_spyre import settings

logger = init_logger(f"vllm.{__name__}")  # vLLM configures the "vllm" tree

_prom: dict[str, object] | None = None


def _metrics() -> dict[str, object] | None:
    """Create the Prometheus series once per process (None without prometheus_client)."""
    global _prom
    if _prom is not None:
        return _prom
    try:
        import prometheus_client as pc
    except ImportError:  # vLLM depends on it; keep the runner usable without
        return None
    _prom = {
        "step": pc.Histogram(
            "spyre:step_modelled_seconds",
            "Modelled spyre device time per engine step",
            buckets=(1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 5.0),
        ),
        "total": pc.Counter(
            "spyre:modelled_device_seconds", "Modelled spyre device time, all steps"
        ),
        "steps": pc.Counter("spyre:steps", "Engine steps run on spyre"),
        "collective": pc.Histogram(
            "spyre:step_collective_modelled_seconds",
            "Modelled card-to-card collective time per engine step (tensor parallel)",
            buckets=(1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0),
        ),
        "collective_total": pc.Counter(
            "spyre:collective_modelled_seconds", "Modelled collective time, all steps"
        ),
        "op_calls": pc.Gauge(
            "spyre:op_calls",
            "Op calls in this worker by how they were served (fallback: on the host)",
            ["path"],
        ),
    }
    port = settings.get().vllm_metrics_port
    # tensor parallel: the worker on card 0 serves the port (collectives end
    # every card's step at the same modelled time); the others log their steps
    if port and _card() == 0:
        try:
            pc.start_http_server(port)
            logger.info("spyre: worker metrics served on port %s", port)
        except OSError as err:  # the engine serves on without its metrics port
            logger.warning(
                "spyre: cannot serve the worker's metrics on port %s (%s); the spyre:* "
                "series are not exported. Set TORCH_SPYRE_VLLM_METRICS_PORT to a free port.",
                port,
                err,
            )
    return _prom


def export() -> None:
    """Create the series (at zero) and open the worker's metrics port now, not
    at the first step: called when the warm-up ends, so the first scrape after
    the server turns ready (llm-d's endpoint picker, a Prometheus) already
    finds every ``spyre:*`` series (the op calls: the warm-up's, a baseline)."""
    _set_op_calls(_metrics())


def _set_op_calls(prom: dict[str, object] | None) -> None:
    """``spyre:op_calls{path}``: the worker's op calls so far, by path."""
    if prom is None:
        return
    from torch_spyre.runtime import dispatch_stats

    for path in dispatch_stats.PATHS:
        n = sum(dispatch_stats.counts(path).values())
        prom["op_calls"].labels(path=path).set(n)  # type: ignore[attr-defined]


def _card() -> int:
    import torch

    try:
        return torch.spyre.current_device()
    except Exception:  # no card in this process (the API server)
        return 0


_PROXY_PID = "_TORCH_SPYRE_VLLM_METRICS_PROXY_PID"
#: the port a collector picked itself (not one the user set)
_PICKED_PORT = "_TORCH_SPYRE_VLLM_METRICS_PICKED_PORT"


class _WorkerMetrics:
    """A Prometheus collector: the worker process's ``spyre:*`` series, read from
    its metrics port at scrape time (nothing when the worker is in this process:
    its series are in this registry already)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def collect(self):
        if _prom is not None:
            return
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=1) as r:
                text = r.read().decode()
        except OSError:  # the engine is starting or gone: no spyre series this scrape
            return
        for family in text_string_to_metric_families(text):
            if family.name.startswith("spyre:"):
                yield family


def install_api_server_collector() -> None:
    """In the process that starts vLLM's engine (the API server): pick the
    worker's metrics port (inherited by the engine process) and collect its
    series into this process's ``/metrics``.  Idempotent; the engine process
    itself (a child, or the same process) does not proxy."""
    import multiprocessing

    owner = settings.inherited(_PROXY_PID)
    if owner == str(os.getpid()) or multiprocessing.current_process().name != "MainProcess":
        return  # installed here already, or we are an engine / worker process vLLM started
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    configured = settings.get().vllm_metrics_port
    port = str(configured) if configured else None
    if owner is not None and port == settings.inherited(_PICKED_PORT):
        # inherited from another process that ran an engine (a script that
        # built an LLM, then started `vllm serve`): the port it picked is its
        # own (a port the user set stays)
        port = None
    if not port:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        settings.handoff("TORCH_SPYRE_VLLM_METRICS_PORT", port)
        settings.handoff(_PICKED_PORT, port)
    settings.handoff(_PROXY_PID, str(os.getpid()))
    REGISTRY.register(_WorkerMetrics(int(port)))


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    modelled_s: float = 0.0
    wall_s: float = 0.0
    last_modelled_s: float = 0.0
    collective_s: float = 0.0
    last_collective_s: float = 0.0
    history: list[tuple[int, int, float]] = field(default_factory=list)  # (tokens, reqs, s)
    wall_history: list[float] = field(default_factory=list)  # wall seconds, same steps
    log_every: int = field(default_factory=lambda: settings.get().vllm_log_steps)

    def record(
        self, tokens: int, reqs: int, modelled_s: float, wall_s: float, collective_s: float = 0.0
    ) -> None:
        """One step: ``modelled_s`` of card time, ``collective_s`` of it in
        card-to-card collectives (tensor parallel; 0 on one card)."""
        self.steps += 1
        self.collective_s += collective_s
        self.last_collective_s = collective_s
        self.tokens += tokens
        self.modelled_s += modelled_s
        self.wall_s += wall_s
        self.last_modelled_s = modelled_s
        if len(self.history) < 10000:
            self.history.append((tokens, reqs, modelled_s))
            self.wall_history.append(wall_s)
        prom = _metrics()
        if prom is not None:
            prom["step"].observe(modelled_s)  # type: ignore[attr-defined]
            prom["total"].inc(modelled_s)  # type: ignore[attr-defined]
            prom["steps"].inc()  # type: ignore[attr-defined]
            if collective_s:
                prom["collective"].observe(collective_s)  # type: ignore[attr-defined]
                prom["collective_total"].inc(collective_s)  # type: ignore[attr-defined]
            _set_op_calls(prom)
        if self.log_every > 0 and self.steps % self.log_every == 0 and collective_s:
            logger.info(
                "spyre step %d (card %d): %d tokens, %d requests, modelled device time "
                "%.3f ms, of which collectives %.3f ms (wall %.1f ms)",
                self.steps,
                _card(),
                tokens,
                reqs,
                modelled_s * 1e3,
                collective_s * 1e3,
                wall_s * 1e3,
            )
        elif self.log_every > 0 and self.steps % self.log_every == 0:
            logger.info(
                "spyre step %d: %d tokens, %d requests, modelled device time %.3f ms "
                "(wall %.1f ms)",
                self.steps,
                tokens,
                reqs,
                modelled_s * 1e3,
                wall_s * 1e3,
            )
