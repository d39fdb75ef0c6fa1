"""Modelled batch-16 decode over a 1k context (the tightest of 1-2k) against its memory floor
(benchmarks/serving_decode.py, timing-only: ~70 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_decode.py"


def test_batch16_decode_within_1_3x_of_the_weights_and_kv_floor():
    pytest.importorskip("vllm")
    r = subprocess.run(
        [sys.executable, str(BENCH), "--context", "1024", "--steps", "2", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert len(rows) == 2
    # decode attention is the paged program (no gathered copies of the context)
    kernels = out["attention_kernels"]
    assert kernels and all(k.endswith("_paged") for k in kernels), kernels
    for row in rows:
        assert 1.0 < row["ratio"] <= 1.3, row
