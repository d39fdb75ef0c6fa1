"""The architecture x path table of docs/models.md, from the rows test_matrix.py measures.

``TORCH_SPYRE_WRITE_DOCS=1 python -m pytest tests/models/test_matrix.py`` rewrites
the table between its markers in docs/models.md; otherwise the table is
written next to the test results only (``$TORCH_SPYRE_MATRIX_OUT``, default
a file in the pytest temporary directory).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

BEGIN = "<!-- architecture-matrix:begin (tests/models/test_matrix.py writes this table) -->"
END = "<!-- architecture-matrix:end -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"

PATHS = ("eager", "generate", "compiled")
TITLES = {
    "eager": 'stock `.to("spyre")` forward (+ HF `generate`)',
    "generate": "adapters + `models.generate`, eager",
    "compiled": "adapters + `torch.compile` + `models.generate`",
}


@dataclass
class Row:
    arch: str
    path: str
    passed: bool
    max_diff: float | None = None  # max |logit| (decoders) or |hidden| (encoders) difference
    ms_per_token: float | None = None  # modelled decode time per token
    fallbacks: int = 0
    note: str = ""


def _cell(r: Row | None) -> str:
    if r is None:
        return "—"
    verdict = "match" if r.passed else "**FAIL**"
    parts = [verdict]
    if r.max_diff is not None:
        parts.append(f"{r.max_diff:.1e}")
    if r.ms_per_token is not None:
        parts.append(f"{r.ms_per_token:.3f} ms/tok")
    if r.fallbacks:
        parts.append(f"{r.fallbacks} fallbacks")
    if r.note:
        parts.append(r.note)
    return ", ".join(parts)


def render(rows: list[Row]) -> str:
    by = {(r.arch, r.path): r for r in rows}
    archs = list(dict.fromkeys(r.arch for r in rows))
    head = "| architecture | " + " | ".join(TITLES[p] for p in PATHS) + " |"
    lines = [head, "|" + "---|" * (len(PATHS) + 1)]
    for a in archs:
        lines.append(f"| {a} | " + " | ".join(_cell(by.get((a, p))) for p in PATHS) + " |")
    return "\n".join(lines)


def write(rows: list[Row], out: Path) -> None:
    out.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    table = render(rows)
    out.with_suffix(".md").write_text(table + "\n")
    if os.environ.get("TORCH_SPYRE_WRITE_DOCS") == "1":
        text = DOCS.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOCS.write_text(text[:start] + "\n" + table + "\n" + text[end:])
