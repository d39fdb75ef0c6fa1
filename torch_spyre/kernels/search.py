"""The one kernel search: candidates, validation, cost, cache.

Every kernel builder with choices (core splits, tiles, double buffering,
operand layouts) finds its plan here: each candidate is built, checked
against the card (``Program.validate``), costed by the timing model and the
fastest kept.  ``Unsupported`` is what a planner raises for anything a
kernel program cannot express (the message names it).
"""

from __future__ import annotations


class Unsupported(NotImplementedError):
    """The planner cannot express this in a kernel program (the message says what)."""
