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
