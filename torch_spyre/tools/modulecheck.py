"""The ModuleInfo sweep: every module of PyTorch's ``module_db``, forward in
eval mode, on spyre against the CPU.

As ``opcheck`` runs OpInfo, this runs
``torch.testing._internal.common_modules.module_db``: each module that
supports the dtype (float32 by default) is built from each of its sample
constructor inputs, run forward in eval mode on the CPU and (a deep copy) on
spyre, and the outputs compared with the project's tolerances
(``torch_spyre.testing.TOLERANCE_TABLE``).  Per module it reports how many
samples match, which raised, and which ops took the host fallback.  A module
*matches* when every sample does; it runs *without the host* when it
matches with no host fallback in any sample.

    python -m torch_spyre.tools.modulecheck [--dtype float32] [--max-samples N] [-v]

``tests/tools/test_modulecheck.py`` runs it in CI and pins the counts.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

from torch_spyre.testing import TOLERANCE_TABLE

#: what a module's forward does that makes its values unrepeatable across two
#: runs (its samples are compared by shape and dtype only)
RANDOM_MODULES = {"nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d", "nn.RReLU"}


@dataclass
class ModuleResult:
    name: str
    samples: int = 0
    matched: int = 0
    mismatched: int = 0
    errors: int = 0
    skipped: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    first_failure: str = ""

    @property
    def ran(self) -> bool:
        return self.samples > 0

    @property
    def match(self) -> bool:
        return self.ran and self.matched == self.samples

    @property
    def no_host(self) -> bool:
        return self.match and not self.fallbacks

    def row(self) -> str:
        status = (
            "no host" if self.no_host else "host" if self.match else "ERROR" if self.errors else
            "MISMATCH" if self.mismatched else "skipped"
        )  # fmt: skip
        fb = ", ".join(f"{k} x{v}" for k, v in sorted(self.fallbacks.items()))
        return f"{self.name:34s} {self.matched:3d}/{self.samples:<3d} {status:9s} {fb}" + (
            f"  [{self.first_failure[:160]}]" if self.first_failure else ""
        )


def _spyre(x):
    return x.to("spyre") if isinstance(x, torch.Tensor) else x


def _compare(out, ref, tol, values: bool) -> None:
    o_flat, r_flat = tree_flatten(out)[0], tree_flatten(ref)[0]
    if len(o_flat) != len(r_flat):
        raise AssertionError(f"{len(o_flat)} outputs on spyre, {len(r_flat)} on cpu")
    for o, r in zip(o_flat, r_flat):
        if isinstance(r, torch.Tensor):
            if not isinstance(o, torch.Tensor) or o.device.type != "spyre":
                raise AssertionError(f"expected a spyre tensor, got {o!r:.80}")
            if o.shape != r.shape or o.dtype != r.dtype:
                raise AssertionError(f"{o.dtype}{list(o.shape)} vs {r.dtype}{list(r.shape)}")
            if values:
                torch.testing.assert_close(o.cpu(), r, rtol=tol[0], atol=tol[1], equal_nan=True)
        elif o != r:
            raise AssertionError(f"{o!r} on spyre, {r!r} on cpu")


def check_module(info, dtype: torch.dtype = torch.float32, max_samples: int | None = None):
    """Run one ModuleInfo's samples on spyre and the CPU."""
    import torch_spyre

    res = ModuleResult(info.formatted_name if hasattr(info, "formatted_name") else info.name)
    if dtype not in info.supported_dtypes("cpu"):
        return res
    torch.manual_seed(0)
    try:
        inputs = info.module_inputs_func(
            info, device="cpu", dtype=dtype, requires_grad=False, training=False
        )
    except Exception as e:  # a sample generator that cannot run here
        res.first_failure = f"samples: {type(e).__name__}: {e}"
        return res
    tol = TOLERANCE_TABLE[dtype]
    values = info.name not in RANDOM_MODULES
    for mi in inputs[:max_samples]:
        if mi.forward_input is None:
            res.skipped += 1
            continue
        c_args, c_kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
        f_args, f_kwargs = mi.forward_input.args, mi.forward_input.kwargs
        flat = tree_flatten((f_args, f_kwargs))[0]
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in flat):
            res.skipped += 1  # the card has no float64 (docs/hardware.md, "dtypes")
            continue
        res.samples += 1
        try:
            torch.manual_seed(0)
            m = info.module_cls(*c_args, **c_kwargs).eval()
            if not info.is_lazy:  # a lazy module has no parameters to cast yet
                m = m.to(dtype)
            torch.manual_seed(1)
            with torch.no_grad():
                ref = m(*f_args, **f_kwargs)
            dev = copy.deepcopy(m).to("spyre")  # after the CPU run: lazy modules are built
            torch_spyre.reset_fallback_counts()
            torch.manual_seed(1)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = dev(*tree_map(_spyre, f_args), **tree_map(_spyre, f_kwargs))
            for op, n in torch_spyre.fallback_counts().items():
                res.fallbacks[op] = res.fallbacks.get(op, 0) + n
        except Exception as e:
            res.errors += 1
            res.first_failure = res.first_failure or f"{type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            _compare(out, ref, tol, values)
            res.matched += 1
        except AssertionError as e:
            res.mismatched += 1
            res.first_failure = res.first_failure or f"mismatch: {str(e)[:300]}"
    return res


def run(
    dtype: torch.dtype = torch.float32,
    max_samples: int | None = None,
    names: set[str] | None = None,
) -> list[ModuleResult]:
    from torch.testing._internal.common_modules import module_db

    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the modules' own deprecation notes
        for info in module_db:
            if names is not None and info.name not in names:
                continue
            results.append(check_module(info, dtype, max_samples))
    return results


def summary(results: list[ModuleResult]) -> dict[str, int]:
    ran = [r for r in results if r.ran]
    return {
        "modules": len(ran),
        "match": sum(r.match for r in ran),
        "no_host": sum(r.no_host for r in ran),
        "mismatch": sum(bool(r.mismatched) for r in ran),
        "error": sum(bool(r.errors) for r in ran),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_spyre.tools.modulecheck")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="a row per module")
    a = p.parse_args(argv)
    results = run(getattr(torch, a.dtype), a.max_samples)
    for r in results:
        if a.verbose or (r.ran and not r.no_host):
            print(r.row())
    s = summary(results)
    print(
        f"{s['modules']} modules ran: {s['match']} match, {s['no_host']} without the host, "
        f"{s['mismatch']} mismatch, {s['error']} raise"
    )
    return 0 if not (s["mismatch"] or s["error"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
