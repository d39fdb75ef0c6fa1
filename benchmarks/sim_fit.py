"""The joint fit of the card's modelling constants (torch_spyre/tools/fit.py):
residual table, fitted values of both explanations, sensitivity table.

    python benchmarks/sim_fit.py        # markdown, as in docs/hardware-model.md
"""

from __future__ import annotations

import math

from torch_spyre.hardware import HardwareConfig
from torch_spyre.tools import fit


def _pub(m: fit.Measurement) -> str:
    p = m.published
    return f"{p[0]:g}-{p[1]:g} {m.unit}" if isinstance(p, tuple) else f"{p:g} {m.unit}"


def main() -> None:
    cfg = HardwareConfig()
    now = fit.evaluate(cfg)
    results = fit.fits()
    sens = fit.sensitivity(cfg)
    names = [r.name for r in results]
    print("| measurement | published | modelled (config) | " + " | ".join(
        f"fit: {n}" for n in names) + " | constrains (d log t / d log p > 0.05) |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for m in fit.MEASUREMENTS:
        v, r = now[m.name]
        cells = [f"{res.modelled[m.name]:.4g} ({math.exp(res.residuals[m.name]):.2f})"
                 for res in results]  # fmt: skip
        strong = [p for p, d in sens[m.name].items() if abs(d) > 0.05]
        print(f"| {m.name} | {_pub(m)} | {v:.4g} ({math.exp(r):.2f}) | " + " | ".join(cells)
              + f" | {', '.join(strong) or 'none (structural)'} |")  # fmt: skip
    rms_now = math.sqrt(sum(r * r for _, r in now.values()) / len(now))
    print(f"| **rms log residual** | | {rms_now:.3f} | " + " | ".join(
        f"{r.rms:.3f}" for r in results) + " | |")  # fmt: skip
    print()
    params = list(fit.PARAMS) + list(fit.CHECKED)
    print("| parameter | config | " + " | ".join(f"fit: {n}" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for p in params:
        vals = [f"{r.values[p]:.4g}" if p in r.values else "(not fitted)" for r in results]
        print(f"| `{p}` | {getattr(cfg, p):.4g} | " + " | ".join(vals) + " |")
    for r in results:
        for q, v in r.nuisance.items():
            print(f"| `{q}` (kernel quality) | — | " + " | ".join(
                f"{v:.3f}" if res is r else "—" for res in results) + " |")  # fmt: skip
    print()
    print("| measurement | " + " | ".join(f"`{p}`" for p in params) + " |")
    print("|---|" + "---|" * len(params))
    for m in fit.MEASUREMENTS:
        print(f"| {m.name} | " + " | ".join(f"{sens[m.name][p]:+.3f}" for p in params) + " |")


if __name__ == "__main__":
    main()
