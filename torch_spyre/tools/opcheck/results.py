"""What one op's samples did on spyre, and the path it is classified under."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Paths of an op, best first.
KERNEL = "device kernel"
ADAPTER = "adapter"
FALLBACK = "host fallback"
FAILS = "fails"
CRASH = "crash"
EXCLUDED = "excluded"
PASSING = (KERNEL, ADAPTER, FALLBACK)
ORDER = (KERNEL, ADAPTER, FALLBACK, FAILS, CRASH)

ERROR_CHARS = 220


@dataclass
class OpResult:
    """What the samples of one OpInfo entry did on spyre."""

    name: str
    variant: str = ""
    samples: int = 0  # samples run on spyre (passed + failed)
    passed: int = 0
    skipped: int = 0
    first_error: str = ""  # the first failure's message
    first_error_at: str = ""  # and its sample: dtype, index, arguments
    raised: int = 0  # failed samples whose op raised (rather than differed)
    raised_named: int = 0  # ... with a message naming the op and a shape
    skip_reasons: dict[str, int] = field(default_factory=dict)
    # path ("kernel"/"adapter"/"fallback") -> aten op -> calls
    dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    values_compared: bool = True
    crashed: str = ""
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    @property
    def first_failure(self) -> str:
        return (
            f"{self.first_error_at}: {self.first_error}"
            if self.first_error_at
            else self.first_error
        )

    @property
    def failed(self) -> int:
        return self.samples - self.passed

    @property
    def path(self) -> str:
        return classify(self)

    def record(self, outcome: SampleOutcome, where: str) -> None:
        if outcome.status == "skipped":
            self.skipped += 1
            self.skip_reasons[outcome.error] = self.skip_reasons.get(outcome.error, 0) + 1
            return
        self.samples += 1
        for (path, op), n in outcome.dispatch.items():
            per_op = self.dispatch.setdefault(path, {})
            per_op[op] = per_op.get(op, 0) + n
        if not outcome.values_compared:
            self.values_compared = False
        if outcome.status == "passed":
            self.passed += 1
            return
        if outcome.raised:
            self.raised += 1
            self.raised_named += outcome.named
        if not self.first_error:
            self.first_error = _truncate(outcome.error)
            self.first_error_at = where


def classify(result: OpResult) -> str:
    """The path of an op, from its sample counts and what dispatch_stats recorded."""
    if result.crashed:
        return CRASH
    if result.samples == 0:
        return EXCLUDED
    if result.passed < result.samples:
        return FAILS
    if result.dispatch.get("fallback"):
        return FALLBACK
    if result.dispatch.get("adapter"):
        return ADAPTER
    # only kernel calls, or none at all (views and other metadata-only ops)
    return KERNEL


@dataclass
class SampleOutcome:
    status: str  # "passed", "failed" or "skipped"
    error: str = ""  # why it failed, or why it was skipped
    dispatch: dict[tuple[str, str], int] = field(default_factory=dict)
    values_compared: bool = True
    raised: bool = False  # the op raised on spyre
    named: bool = False  # ... and the message names the op and a shape


def _truncate(text: str, limit: int = ERROR_CHARS) -> str:
    # one line, and no object addresses: the report must not change between runs
    text = re.sub(r"0x[0-9a-fA-F]+", "0x..", " ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."
