"""The API server's collector of the worker's spyre:* series, when the
environment was inherited from another process that ran an engine (a script
that built an LLM, then started `vllm serve`): a port of its own."""

import os

import pytest

from torch_spyre.vllm_plugin import metrics


@pytest.fixture
def fresh_registry(monkeypatch):
    prometheus_client = pytest.importorskip("prometheus_client")
    registered = []
    monkeypatch.setattr(prometheus_client.REGISTRY, "register", registered.append)
    return registered


def test_inherited_port_is_not_reused(monkeypatch, fresh_registry, spyre_settings):
    monkeypatch.setenv(metrics._PROXY_PID, str(os.getpid() + 100000))  # another process
    spyre_settings(vllm_metrics_port=1)
    monkeypatch.setenv(metrics._PICKED_PORT, "1")  # ... picked it
    metrics.install_api_server_collector()
    assert len(fresh_registry) == 1
    assert os.environ["TORCH_SPYRE_VLLM_METRICS_PORT"] != "1"
    assert os.environ[metrics._PROXY_PID] == str(os.getpid())
    metrics.install_api_server_collector()  # idempotent in the same process
    assert len(fresh_registry) == 1


def test_a_port_the_user_set_stays(monkeypatch, fresh_registry, spyre_settings):
    monkeypatch.setenv(metrics._PROXY_PID, str(os.getpid() + 100000))
    monkeypatch.setenv(metrics._PICKED_PORT, "1")
    spyre_settings(vllm_metrics_port=4242)
    metrics.install_api_server_collector()
    assert os.environ["TORCH_SPYRE_VLLM_METRICS_PORT"] == "4242"


def test_worker_serves_on_without_its_port(monkeypatch, fresh_registry, spyre_settings):
    import socket

    warned = []
    # vLLM's loggers may not propagate to pytest's capture: record the call itself
    monkeypatch.setattr(metrics.logger, "warning", lambda msg, *a: warned.append(msg % a))

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        spyre_settings(vllm_metrics_port=taken.getsockname()[1])
        monkeypatch.setattr(metrics, "_prom", None)
        assert metrics._metrics() is not None  # no OSError out of the engine step
    assert any("cannot serve the worker's metrics" in w for w in warned)
