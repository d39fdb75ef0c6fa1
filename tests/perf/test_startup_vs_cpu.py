"""benchmarks/startup.py --vs-cpu: the same forward compiled by the spyre
backend and by Inductor's CPU backend, cold and warm, each in a fresh
process (issue 30, item 5).  Wall-clock figures are printed, not asserted:
only that every run compiled, and that the warm run loaded the graphs the
cold run compiled (Inductor's FX graph cache hits)."""

import json

import benchmark_module
import pytest


@pytest.mark.slow  # four fresh processes, two with a cold C++ compile: ~1 min
def test_startup_compares_compile_time_with_inductors_cpu_backend(tmp_path, capsys):
    startup = benchmark_module.load("startup")
    out = tmp_path / "vs_cpu.json"
    assert startup.main(["--vs-cpu", "--depths", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["model"] == "granite x2"
    for device in ("spyre", "cpu"):
        cold, warm = row[device]["cold"], row[device]["warm"]
        assert set(cold["by_tokens"]) == {"16", "64"}
        assert cold["compile_s"] > 0 and cold["fx_graph_cache_hits"] == 0
        # the warm process loads both shapes' graphs the cold one compiled
        assert warm["fx_graph_cache_hits"] == 2
    text = capsys.readouterr().out
    assert "| granite x2 |" in text and "Inductor CPU cold" in text
