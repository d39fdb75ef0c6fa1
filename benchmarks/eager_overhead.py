"""Eager overhead: host wall time per op on spyre vs CPU for small tensors.

Both columns are measured in the same run, on the same machine; the ratio is
what matters.  A second table times the first call of an op with a shape the
kernel cache has not seen (program build + LX/timing estimate).
Targets (issue 4): warm small op <= 30 us, first call with a new shape <= 50 ms.
Run: python benchmarks/eager_overhead.py
"""

from __future__ import annotations

import time
import warnings

import torch

import torch_spyre


def _per_call_us(fn, iters: int) -> float:
    for _ in range(max(iters // 10, 3)):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def cases(device: str):
    a = torch.randn(64, 64, dtype=torch.float16).to(device)
    b = torch.randn(64, 64, dtype=torch.float16).to(device)
    host = torch.randn(64, 64, dtype=torch.float16)
    dst = torch.empty(64, 64, dtype=torch.float16, device=device)
    return {
        "add 64x64 fp16": lambda: a + b,
        "mul 64x64 fp16": lambda: a * b,
        "view": lambda: a.view(4096),
        "transpose": lambda: a.t(),
        "empty 64x64": lambda: torch.empty(64, 64, dtype=torch.float16, device=device),
        "copy host->dev": lambda: dst.copy_(host),
        "copy dev->dev": lambda: dst.copy_(a),
    }


def main(iters: int = 300) -> list[tuple[str, float, float]]:
    torch_spyre.set_fallback_policy("silent")
    rows = []
    cpu, spy = cases("cpu"), cases("spyre")
    for name in cpu:
        rows.append((name, _per_call_us(cpu[name], iters), _per_call_us(spy[name], iters)))
    print(f"{'op':<18}{'cpu us':>10}{'spyre us':>11}{'ratio':>8}")
    for name, c, s in rows:
        print(f"{name:<18}{c:>10.2f}{s:>11.2f}{s / c:>8.1f}")
    counts = torch_spyre.fallback_counts()
    print(f"ops through the host fallback: {sorted(counts)}")
    print()
    print(f"{'first call, new shape':<28}{'ms':>8}")
    for name, ms in first_calls():
        print(f"{name:<28}{ms:>8.2f}")
    return rows


def first_calls() -> list[tuple[str, float]]:
    out = []
    for i, (name, fn) in enumerate(
        [
            ("add", lambda x: x + x),
            ("sum(-1)", lambda x: x.sum(-1)),
            ("softmax(-1)", lambda x: torch.softmax(x, -1)),
            ("x @ x.T", lambda x: x @ x.mT),
            ("layer_norm", lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:])),
        ]
    ):
        x = torch.randn(97 + i, 131 + i, dtype=torch.float16).to("spyre")
        t0 = time.perf_counter()
        fn(x)
        out.append((f"{name} {list(x.shape)}", (time.perf_counter() - t0) * 1e3))
    return out


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
