"""The one kernel search: candidates, validation, cost, cache.

Every kernel builder with choices (core splits, tiles, double buffering,
operand layouts) finds its plan here, the same way:

    for each candidate:  build it  ->  check it fits the card  ->  cost it
    keep the fastest (an earlier candidate wins a tie)

* **build**: ``build(candidate)`` returns a program (or anything ``cost``
  takes); a candidate the builder or the card rejects (``ProgramError``,
  ``Unsupported``: the LX overflows, a span is too large, a shape the
  program cannot express) is skipped, and the first rejection is kept to
  explain a search that found nothing;
* **validation**: a built ``Program`` is checked with ``validate(config)``
  (``validate=False`` when the builder already did, or when ``fits`` says
  what fits);
* **cost**: the timing model's modelled time (``sim.estimate``), or the
  caller's ``cost`` (a layout choice adds what its readers pay);
* **cache**: ``Memo`` keeps finished searches (bounded), in memory and,
  with ``persist=``, in the persistent artifact cache that other processes
  read (``runtime/artifact_cache.py``); the card's own estimate cache keeps
  the timing of each program.

``Search`` is the loop as an object, for searches run in stages (flash
attention tries single buffering only while nothing double buffered fits);
``search`` is one stage.  ``Unsupported`` is what a planner raises for
anything a kernel program cannot express (the message names it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch_spyre.ir import ProgramError
from torch_spyre.runtime import artifact_cache
from torch_spyre.sim import estimate

C = TypeVar("C")
R = TypeVar("R")


class Unsupported(NotImplementedError):
    """The planner cannot express this in a kernel program (the message says what)."""


class NoPlan(ProgramError):
    """No candidate of a search fits the card; ``first`` is the first rejection."""

    def __init__(self, message: str, first: BaseException | None = None) -> None:
        super().__init__(message)
        self.first = first


@dataclass(frozen=True)
class Found(Generic[C, R]):
    """The fastest candidate so far: what it built and its modelled seconds."""

    candidate: C
    result: R
    time_s: float


#: what a build may raise for a candidate that does not fit (skipped)
REJECTED: tuple[type[BaseException], ...] = (ProgramError, Unsupported)


class Search(Generic[C, R]):
    """Build, check and cost candidates, keeping the fastest.

    ``margin``: a later candidate must be faster by more than this many
    seconds (a tolerance for modelled ties); ``first_fit``: keep the first
    candidate that fits and cost nothing (naive baselines, single
    candidates); ``baseline``: the plan to beat (``Found``), e.g. the
    default layout; ``fits``: an extra check of a built result (False
    skips it).
    """

    def __init__(
        self,
        build: Callable[[C], R],
        config: Any,
        *,
        cost: Callable[[R], float] | None = None,
        validate: bool = True,
        fits: Callable[[R], bool] | None = None,
        margin: float = 0.0,
        first_fit: bool = False,
        baseline: Found[C, R] | None = None,
        rejected: tuple[type[BaseException], ...] = REJECTED,
    ) -> None:
        self.build = build
        self.config = config
        self.cost = cost
        self.validate = validate
        self.fits = fits
        self.margin = margin
        self.first_fit = first_fit
        self.best: Found[C, R] | None = baseline
        self.first_error: BaseException | None = None
        self.rejected = rejected
        self.tried = 0

    def consider(self, candidate: C) -> Found[C, R] | None:
        """Build, check and cost one candidate; returns the best so far."""
        if self.first_fit and self.best is not None:
            return self.best
        self.tried += 1
        try:
            result = self.build(candidate)
            if self.validate:
                result.validate(self.config)  # type: ignore[attr-defined]
        except self.rejected as err:
            if self.first_error is None:
                self.first_error = err
            return self.best
        if self.fits is not None and not self.fits(result):
            return self.best
        if self.first_fit:
            self.best = Found(candidate, result, float("nan"))
            return self.best
        t = self.cost(result) if self.cost is not None else estimate(result, self.config).time_s
        if self.best is None or t < self.best.time_s - self.margin:
            self.best = Found(candidate, result, t)
        return self.best

    def run(self, candidates: Iterable[C]) -> Found[C, R] | None:
        """``consider`` each candidate in order; returns the best so far."""
        for c in candidates:
            self.consider(c)
            if self.first_fit and self.best is not None:
                break
        return self.best

    def result(self, what: str) -> Found[C, R]:
        """The best found; ``NoPlan`` naming ``what`` and the first rejection when none."""
        if self.best is None:
            why = f": {self.first_error}" if self.first_error is not None else ""
            raise NoPlan(f"{what}: no candidate fits the card{why}", self.first_error)
        return self.best


def search(
    candidates: Iterable[C],
    build: Callable[[C], R],
    config: Any,
    what: str = "kernel",
    **options: Any,
) -> Found[C, R]:
    """The fastest of ``candidates`` (``Search``'s options); ``NoPlan`` when none fits."""
    s: Search[C, R] = Search(build, config, **options)
    s.run(candidates)
    return s.result(what)


class Memo:
    """Finished searches by key (bounded: cleared past ``limit`` entries).

    A search that raised (``Unsupported``, ``NoPlan``) is remembered too and
    raised again: a model's layers repeat the same kernels, and the search is
    the bulk of planning time.

    ``persist="namespace"``: finished searches also go to the persistent
    artifact cache (``runtime.artifact_cache``, ``TORCH_SPYRE_CACHE_DIR``),
    keyed by the canonical form of ``key`` and the code version, so that
    another process finds them instead of searching again.  Only for searches
    whose result depends on nothing but the key (the hardware config and
    planning options belong in it); a key with no canonical form is kept in
    memory only."""

    def __init__(self, limit: int = 4096, persist: str | None = None) -> None:
        self.limit = limit
        self.persist = persist
        self._done: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self._done)

    def clear(self) -> None:
        self._done.clear()

    def get(self, key: Hashable, compute: Callable[[], R], remember: tuple = ()) -> R:
        """``compute()`` once per key; errors of a type in ``remember`` are kept
        and raised again (as a new exception of the same type and message)."""
        hit = self._done.get(key, _MISSING)
        if hit is _MISSING:
            disk = self._disk_key(key)
            if disk is not None:
                found = artifact_cache.load(self.persist, disk)  # type: ignore[arg-type]
                if found is not None:
                    hit = found[0]
            if hit is _MISSING:
                try:
                    hit = compute()
                except remember as err:
                    hit = _Raised(type(err)(str(err)))
                if disk is not None:
                    artifact_cache.store(self.persist, disk, (hit,))  # type: ignore[arg-type]
            if len(self._done) > self.limit:
                self._done.clear()
            self._done[key] = hit
        if isinstance(hit, _Raised):
            raise type(hit.error)(str(hit.error))
        return hit

    def _disk_key(self, key: Hashable) -> str | None:
        if self.persist is None:
            return None
        try:
            return artifact_cache.key_of(self.persist, key)
        except artifact_cache.Uncacheable:
            return None


def persisted(namespace: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A search function memoised in memory and in the persistent artifact
    cache (``Memo(persist=namespace)``), keyed by its arguments; its errors of
    the rejection types (``REJECTED``) are remembered too."""

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        memo = Memo(persist=namespace)

        @functools.wraps(fn)
        def cached(*args: Any, **kwargs: Any) -> R:
            key = (fn.__qualname__, args, tuple(sorted(kwargs.items())))
            try:
                hash(key)
            except TypeError:  # an unhashable argument: searched every time
                return fn(*args, **kwargs)
            return memo.get(key, lambda: fn(*args, **kwargs), remember=REJECTED)

        cached.memo = memo  # type: ignore[attr-defined]
        return cached

    return wrap


_MISSING = object()


@dataclass(frozen=True)
class _Raised:
    error: BaseException


__all__ = [
    "REJECTED",
    "Found",
    "Memo",
    "NoPlan",
    "Search",
    "Unsupported",
    "persisted",
    "search",
]
