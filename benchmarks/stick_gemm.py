"""The executor's in-place weight matmul (``_card.stick_gemm``) against a re-lay +
cast of the weight and a host GEMM, by rows of the other operand.

``sim/direct.py`` takes the kernel up to ``GEMV_ROWS`` rows and the host GEMM
above; this prints the wall times that choice rests on (one thread, best of
``--repeat`` x 20 calls, one process) for decode-shaped fp16 weights.  No
modelled figure: both paths compute the same sums of the same products.

    python benchmarks/stick_gemm.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from torch_spyre import _card  # noqa: E402
from torch_spyre.sim import direct  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (5632, 2048)]  # SmolLM2 MLP up / down, a 1B MLP up
ROWS = [1, 2, 4, 8, 16, 32]


def _us(fn, repeat: int, n: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"one thread; sim/direct.py GEMV_ROWS = {direct.GEMV_ROWS}")
    print(f"{'weight N x K':>14} {'rows':>5} {'kernel us':>10} {'re-lay+GEMM us':>15} {'ratio':>6}")
    for n, k in SHAPES:
        # the device's [K / 64, N, 64] sticks, viewed in host order
        w = torch.randn(k // 64, n, 64).half().permute(1, 0, 2)
        for rows in ROWS:
            a = torch.randn(rows, k)
            t_kernel = _us(lambda a=a, w=w, k=k: _card.stick_gemm(a, w, k, k, 1), args.repeat)
            t_host = _us(lambda a=a, w=w, k=k: direct._host_gemm(a, w, k, k, 1), args.repeat)
            print(
                f"{f'{n} x {k}':>14} {rows:>5} {t_kernel:>10.0f} {t_host:>15.0f}"
                f" {t_kernel / t_host:>6.2f}"
            )


if __name__ == "__main__":
    main()
