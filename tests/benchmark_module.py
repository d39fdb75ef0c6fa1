"""A benchmark script (benchmarks/NAME.py) imported as a module by the tests
that pin its figures: the benchmarks are scripts, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/``name``.py, imported once as ``spyre_bench_<name>``."""
    key = f"spyre_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
