"""Modelled time vs the card's roofline for each hand-built program.

    python benchmarks/sim_roofline.py [--png roofline.png] [--trace trace.json]

Also prints the calibration table (modelled vs published Spyre figures).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch_spyre.profiler as sprof  # noqa: E402
from torch_spyre import kernels as K  # noqa: E402
from torch_spyre.hardware import HardwareConfig  # noqa: E402
from torch_spyre.sim import SimulatedCard  # noqa: E402
from torch_spyre.tools.calibration import calibration_table  # noqa: E402


def programs():
    return [
        K.elementwise("add", (8192, 8192)),
        K.elementwise("add", (256, 1024)),
        K.elementwise("gelu", (4096, 4096), num_inputs=1),
        K.matmul(4096, 4096, 4096),
        K.matmul(4096, 4096, 4096, multicast=False),
        K.matmul(2048, 2048, 2048, split=(1, 1, 1)),
        K.matmul(512, 4096, 4096, split=(8, 4, 1)),
        K.gemv(4096, 25600, cores=25),
        K.matmul(64, 64, 32768, split=(1, 1, 32)),
        K.softmax(512, 1024, cores=1),
        K.softmax(512, 1024, cores=1, spill=True),
        K.softmax(4096, 2048),
        K.rmsnorm(512, 4096),
        K.layernorm(512, 4096),
        K.ring_allreduce(32, 262144),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--png", help="write a roofline plot (needs matplotlib)")
    ap.add_argument("--trace", help="write a Chrome trace of all programs")
    args = ap.parse_args()
    cfg = HardwareConfig.from_env()
    card = SimulatedCard(0, cfg)
    with sprof.profile(cfg) as prof:
        for p in programs():
            card.run(p)
    print(
        f"card: {cfg.cores} cores, {cfg.peak_flops() / 1e12:.3f} TFLOP/s fp16, "
        f"{cfg.memory_bandwidth_Bps / 1e9:.1f} GB/s peak ({cfg.dram_efficiency:.1%} sustained), "
        f"ridge {cfg.ridge_point():.0f} FLOP/B\n"
    )
    head = (
        f"{'program':<28} {'cores':>5} {'modelled us':>12} {'roofline us':>12} "
        f"{'attain':>7} {'bound':>9} {'util':>5} {'MB moved':>9} {'GFLOP':>8}"
    )
    print(head)
    print("-" * len(head))
    for k in prof.kernels:
        r = k.report
        print(
            f"{r.name[:28]:<28} {r.cores_used:>5} {r.time_s * 1e6:>12.2f} "
            f"{r.roofline_time_s * 1e6:>12.2f} {r.attainment:>7.0%} {r.bottleneck:>9} "
            f"{r.utilisation:>5.0%} {r.dram_bytes / 1e6:>9.2f} {r.flops / 1e9:>8.2f}"
        )
    print("\ncalibration against published Spyre figures:\n")
    print(calibration_table(cfg))
    if args.png:
        prof.roofline_plot(args.png)
        print(f"\nwrote {args.png}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")


if __name__ == "__main__":
    main()
