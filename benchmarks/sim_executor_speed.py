"""Functional executor speed: a 4096^3 fp16 matmul program vs torch.matmul on the host.

Target (issue 3): the program takes at most 3x the wall time of
torch.matmul of the same fp16 operands on the host, measured in one run.

    python benchmarks/sim_executor_speed.py [--size 4096] [--repeat 1]

Note: on CPUs without native fp16 GEMM (no AVX512-FP16/AMX), torch's host
fp16 matmul is a slow reference kernel (minutes at 4096^3); the fp32 host
matmul is printed for context.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from torch_spyre import kernels as K  # noqa: E402
from torch_spyre.sim import SimulatedCard  # noqa: E402


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    n = args.size
    torch.manual_seed(0)
    a = torch.randn(n, n, dtype=torch.float16)
    b = torch.randn(n, n, dtype=torch.float16)
    p = K.matmul(n, n, n)
    card = SimulatedCard(0)
    bufs = {
        "a": p.operand("a").layout.to_device(a),
        "b": p.operand("b").layout.to_device(b),
        "out": torch.empty(p.operand("out").layout.device_size, dtype=torch.float16),
    }
    card.run(K.matmul(256, 256, 256), None)  # warm up imports
    sim = _best(lambda: card.run(p, bufs), args.repeat)
    rep = card.run(p)
    f32 = _best(lambda: torch.matmul(a.float(), b.float()), args.repeat)
    host = _best(lambda: torch.matmul(a, b), args.repeat)
    out = p.operand("out").layout.to_host(bufs["out"])
    ref = torch.matmul(a.float(), b.float()).half()
    err = (out.float() - ref.float()).abs().max().item()
    print(f"matmul {n}x{n}x{n} fp16, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'what':<44} {'wall s':>10}")
    print(f"{'simulated card: card.run(program, buffers)':<44} {sim:>10.3f}")
    print(f"{'host torch.matmul fp16 (reference)':<44} {host:>10.3f}")
    print(f"{'host torch.matmul fp32 (context)':<44} {f32:>10.3f}")
    print(f"ratio sim / host fp16 = {sim / host:.4f}  (target <= 3)")
    print(f"ratio sim / host fp32 = {sim / f32:.2f}")
    print(f"max |sim - fp32 reference rounded to fp16| = {err:.3g}")
    print(f"modelled: {rep.summary()}")


if __name__ == "__main__":
    main()
