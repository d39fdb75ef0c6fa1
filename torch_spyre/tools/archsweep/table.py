"""The sweep's results as docs/models.md's table and its totals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from torch_spyre.tools.archsweep.run import Row

BEGIN = "<!-- archsweep:begin -->"
END = "<!-- archsweep:end -->"


@dataclass
class Totals:
    types: int
    runs_on_cpu: int
    eager_match: int
    compiled_match: int
    compiled_clean: int  # compiled, matching, with no degraded node and no host fallback
    wrong: int  # a mismatch on either path: a silent wrong answer
    aborted: int  # a compile that raised

    def lines(self) -> list[str]:
        n = max(self.runs_on_cpu, 1)

        def pct(k: int) -> str:
            return f"{k} ({100 * k / n:.1f}%)"

        return [
            f"- model types swept: {self.types}; run on the CPU with the tiny config: "
            f"{self.runs_on_cpu}",
            f"- match eagerly: {pct(self.eager_match)}",
            f"- match compiled: {pct(self.compiled_match)}",
            f"- compiled with no degraded node and no host fallback: {pct(self.compiled_clean)}",
            f"- mismatches (silent wrong answers): {self.wrong}",
            f"- compiles that raised: {self.aborted}",
        ]


def totals(rows: list[Row]) -> Totals:
    ok = [r for r in rows if r.status == "ok"]
    return Totals(
        types=len(rows),
        runs_on_cpu=len(ok),
        eager_match=sum(r.eager.verdict == "match" for r in ok),
        compiled_match=sum(r.compiled.verdict == "match" for r in ok),
        compiled_clean=sum(
            r.compiled.verdict == "match"
            and not sum(r.compiled.degraded.values())
            and not r.compiled.host_fallbacks
            for r in ok
        ),
        wrong=sum("mismatch" in (r.eager.verdict, r.compiled.verdict) for r in ok),
        aborted=sum(r.compiled.verdict == "error" for r in ok),
    )


def _num(x: float, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _verdict(v: str, err: str) -> str:
    if v != "error":
        return v
    return "error: " + err.split(":")[0]


def markdown(rows: list[Row]) -> str:
    rows = sorted(rows, key=lambda r: (r.family, r.type))
    out = [
        "| type | family | mode | eager | compiled | max diff (compiled) | host fallbacks "
        "(eager / compiled) | degraded nodes | modelled ms/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.status != "ok":
            reason = r.error.split(":")[0] if r.error else ""
            out.append(
                f"| {r.type} | {r.family} | | {r.status} ({reason}) | | | | | |".replace("( )", "")
            )
            continue
        e, c = r.eager, r.compiled
        out.append(
            f"| {r.type} | {r.family} | {r.mode} | {_verdict(e.verdict, e.error)} | "
            f"{_verdict(c.verdict, c.error)} | {_num(c.max_diff, '.1e')} | "
            f"{e.host_fallbacks} / {c.host_fallbacks} | {sum(c.degraded.values())} | "
            f"{_num(c.modelled_ms_per_token, '.3f')} |"
        )
    return "\n".join(out)


def write_doc(rows: list[Row], path: Path) -> None:
    """Replace the sweep's section of ``path`` (between the markers) with the table."""
    body = "\n".join([BEGIN, *totals(rows).lines(), "", markdown(rows), END])
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + body + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    path.write_text(text)
