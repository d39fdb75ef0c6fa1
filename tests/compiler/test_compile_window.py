"""Card work done while compiling is not billed to the user's call.

Compiling a graph runs some work on the card (constants read back by a graph
pass, uploaded by the lowering, saved and loaded by the caches, fills); a
warm cache does other work than a cold one.  None of it is the user's call:
the card's clock stands still from Dynamo's compile start to its end
(sim/card.py ``compile_started``, compiler/__init__.py ``compile_window``).
"""

from __future__ import annotations

import torch

from torch_spyre import _card

SPYRE = torch.device("spyre")


def _busy_backend(seen: list):
    """A backend that runs card work while it compiles (a fill, a read-back)."""

    def backend(gm, example_inputs):
        before = torch.spyre.modelled_time_s()
        torch.full((64, 64), 2.0, device=SPYRE).cpu()
        seen.append((torch.spyre.modelled_time_s() - before, _card.unbilled()))
        return gm.forward

    return backend


def test_compile_time_card_work_is_not_billed():
    seen: list = []
    fn = torch.compile(lambda x: x, backend=_busy_backend(seen), fullgraph=True)
    x = torch.ones(4, 64, device=SPYRE)
    clock = torch.spyre.modelled_time_s()
    fn(x)
    assert seen == [(0.0, True)]  # the backend's work ran, inside the window
    assert torch.spyre.modelled_time_s() == clock  # the call itself runs nothing
    assert not _card.unbilled()
    # outside a compilation the same work is billed
    torch.full((64, 64), 2.0, device=SPYRE).cpu()
    assert torch.spyre.modelled_time_s() > clock


def test_the_window_survives_a_dynamo_reset():
    """torch._dynamo.reset() clears Dynamo's callbacks; the window is registered
    again at once, so the next compile is unbilled whatever backend runs it,
    and whether or not a cache hit skips the spyre passes."""
    from torch._dynamo.callback import callback_handler

    from torch_spyre.sim import card

    torch._dynamo.reset()
    assert card.compile_started in callback_handler.start_callbacks
    assert card.compile_ended in callback_handler.end_callbacks
    seen: list = []
    fn = torch.compile(lambda x: x, backend=_busy_backend(seen), fullgraph=True)
    fn(torch.ones(4, 64, device=SPYRE))
    assert seen == [(0.0, True)]
    assert not _card.unbilled()


def _filling_backend(seen: list):
    """A backend that makes a constant on the card while it compiles."""

    def backend(gm, example_inputs):
        seen.append(torch.arange(64.0, device=SPYRE).mul(2.0).cpu())
        return gm.forward

    return backend


def test_compile_time_card_work_executes_in_a_timing_only_run():
    """``timing_only()`` skips the programs of the user's calls, not a
    compilation's: a constant made while compiling is read by every later
    call, so it must hold its values (a warm-up under ``timing_only``, as
    vLLM's, would otherwise leave garbage constants behind)."""
    from torch_spyre.sim import card, timing_only

    seen: list = []
    fn = torch.compile(lambda x: x + 1, backend=_filling_backend(seen), fullgraph=True)
    with timing_only():
        assert card.timing_only_active()
        fn(torch.ones(4, 64, device=SPYRE))
        with card.compiling():
            assert not card.timing_only_active()
            made = torch.full((8, 64), 3.0, device=SPYRE).cpu()
        assert card.timing_only_active()
    torch.testing.assert_close(seen[0], torch.arange(64.0) * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(made, torch.full((8, 64), 3.0), rtol=0, atol=0)


def test_a_shape_compiled_at_run_time_is_inside_the_window():
    """``piecewise.compile_outside`` (a bucket's graph compiled at its first
    call, outside Dynamo's compile) opens the window itself: unbilled, and
    executed in a timing-only run; the window closes after it, nested or not."""
    from torch_spyre.compiler import piecewise
    from torch_spyre.sim import timing_only

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    seen: list = []

    def compile_fn(graph, fake_inputs):
        before = torch.spyre.modelled_time_s()
        made = torch.arange(64.0, device=SPYRE).add(1.0).cpu()
        seen.append((torch.spyre.modelled_time_s() - before, _card.unbilled(), made))
        return graph.forward

    x = torch.ones(4, 64, device=SPYRE)
    with timing_only():
        piecewise.compile_outside(compile_fn, gm, [x])
    assert not _card.unbilled()
    assert seen[0][:2] == (0.0, True)
    torch.testing.assert_close(seen[0][2], torch.arange(64.0) + 1.0, rtol=0, atol=0)
    from torch_spyre.sim import card

    with card.compiling():
        piecewise.compile_outside(compile_fn, gm, [x])
        assert _card.unbilled()  # the outer window stays open
    assert not _card.unbilled()
