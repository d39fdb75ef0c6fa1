"""Modelled device time per engine step: a log line and Prometheus metrics.

The metrics live in the process that runs the worker (vLLM's engine core):

* ``spyre:step_modelled_seconds`` (histogram): modelled card time of each step
  (forward + LM head + the step's host<->device copies);
* ``spyre:modelled_device_seconds_total`` (counter) and ``spyre:steps_total``.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` that is the API server's process and
they appear on its ``/metrics``. With the default separate engine process, set
``TORCH_SPYRE_VLLM_METRICS_PORT`` and the worker serves them on that port.
``TORCH_SPYRE_VLLM_LOG_STEPS=N`` logs every N-th step (default 1, 0 = never).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm.logger import init_logger

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
    }
    port = os.environ.get("TORCH_SPYRE_VLLM_METRICS_PORT")
    if port:
        pc.start_http_server(int(port))
        logger.info("spyre: worker metrics served on port %s", port)
    return _prom


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    modelled_s: float = 0.0
    wall_s: float = 0.0
    last_modelled_s: float = 0.0
    history: list[tuple[int, int, float]] = field(default_factory=list)  # (tokens, reqs, s)
    wall_history: list[float] = field(default_factory=list)  # wall seconds, same steps
    log_every: int = field(
        default_factory=lambda: int(os.environ.get("TORCH_SPYRE_VLLM_LOG_STEPS", "1"))
    )

    def record(self, tokens: int, reqs: int, modelled_s: float, wall_s: float) -> None:
        self.steps += 1
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
        if self.log_every > 0 and self.steps % self.log_every == 0:
            logger.info(
                "spyre step %d: %d tokens, %d requests, modelled device time %.3f ms "
                "(wall %.1f ms)",
                self.steps,
                tokens,
                reqs,
                modelled_s * 1e3,
                wall_s * 1e3,
            )
