"""The card's stream error: a launch that fails on the card leaves the card in
error (IBM's ``SpyreDeviceState.StreamError``) until it is reset."""

import pytest
import torch

import torch_spyre  # noqa: F401
from torch_spyre import _C
from torch_spyre.runtime import cards
from torch_spyre.sim import card as sim_card
from torch_spyre.sim.card import StreamError


@pytest.fixture
def faulting_card(monkeypatch):
    """Every program the card executes faults while it runs (what a DMA or
    core fault does on the card), until the fixture ends."""

    def faulty_runner(program):
        def run(buffers):
            raise RuntimeError(f"DMA fault in {program.name}")

        return run

    from torch_spyre.runtime import launch

    monkeypatch.setattr(sim_card, "runner", faulty_runner)
    monkeypatch.setattr(launch, "runner", faulty_runner)
    launch.clear_cache()  # kernels built (and warm entries made) before the fault
    _C._warm_clear()
    yield
    torch.spyre.reset_device_state()
    launch.clear_cache()


def test_healthy_card_is_ok():
    torch.spyre.reset_device_state()
    assert _C.get_device_state() == _C.SpyreDeviceState.Ok
    assert torch.spyre.stream_error() == ""
    s = _C.current_stream(torch.device("spyre"))
    assert _C.stream_get_error(s) == _C.SpyreStreamError.Success


def test_failed_launch_puts_the_card_into_stream_error(faulting_card, monkeypatch):
    a = torch.randn(4, 64).to("spyre")
    b = torch.randn(4, 64).to("spyre")
    with pytest.raises(StreamError, match="DMA fault"):
        torch.ops.aten.mul(a, b)  # a program the card runs (no warm entry yet)
    assert _C.get_device_state() == _C.SpyreDeviceState.StreamError
    assert _C.get_device_state().name == "StreamError"
    assert "DMA fault" in torch.spyre.stream_error()
    s = _C.current_stream(torch.device("spyre"))
    assert _C.stream_get_error(s) == _C.SpyreStreamError.Shutdown
    assert _C.stream_get_error_string(_C.stream_get_error(s)) == "Shutdown"

    # the card stays in error, even when the fault is gone: it refuses launches
    # (every path: the card's run, the prepared fast path, the C++ warm path) ...
    monkeypatch.undo()
    for op in (torch.add, torch.mul, torch.sub):
        with pytest.raises(StreamError, match="reset_device_state"):
            op(a, b)
    # ... and transfers
    with pytest.raises(StreamError):
        a.cpu()
    with pytest.raises(StreamError):
        torch.ones(3).to("spyre")
    assert _C.get_device_state() == _C.SpyreDeviceState.StreamError

    # until it is reset
    torch.spyre.reset_device_state()
    assert _C.get_device_state() == _C.SpyreDeviceState.Ok
    torch.testing.assert_close((a + b).cpu(), a.cpu() + b.cpu())


def test_refused_launch_is_no_stream_error():
    """A launch refused before it runs (an integer out of the card's exact
    range) is an error of the call, not of the card."""
    from torch_spyre.sim.executor import IntegerRangeError

    torch.spyre.reset_device_state()
    x = torch.full((4, 70), 2**20, dtype=torch.int64)
    with pytest.raises(IntegerRangeError):
        torch.compile(lambda t: (t * 3).sum(-1), fullgraph=True, dynamic=False)(x.to("spyre"))
    assert _C.get_device_state() == _C.SpyreDeviceState.Ok


def test_a_study_card_has_no_stream_error(monkeypatch):
    """A card made for a study (its own clock) is not one of the process's cards."""
    study = sim_card.SimulatedCard(0)
    study.fail_stream("x")
    assert study.stream_error() == ""
    assert cards.stream_error(0) == ""


def test_enum_names_and_values():
    assert int(_C.SpyreDeviceState.Ok) == 0
    assert int(_C.SpyreDeviceState.NotInitialized) == 1
    assert int(_C.SpyreDeviceState.StreamError) == 2
    assert int(_C.SpyreStreamError.Shutdown) == 1
    assert str(_C.SpyreDeviceState.Ok) == "SpyreDeviceState.Ok"
