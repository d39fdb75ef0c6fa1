"""``torch_spyre._inductor``: IBM's compiler options, constants and decompositions."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from torch_spyre.layout import (
    STICK_BYTES,
)


class InductorConfig(types.ModuleType):
    """``torch_spyre._inductor.config``: IBM's option names over our compiler
    options.  ``sencores`` is the planning core count
    (``torch_spyre.kernels.options``); every other IBM option is accepted and
    kept, and has no effect here (docs/compat.md says why, per option)."""

    #: IBM's options and their defaults; only `sencores` changes our planning
    DEFAULTS: dict[str, Any] = {
        "lx_planning": True,
        "co_optimizing_lx_planning": False,
        "hbm_pool_planning": True,
        "enable_lx_context_switching": True,
        "frontend_pool_allocation": False,
        "conv2d_direct_lowering": False,
        "ktir_emitter": False,
        "async_dxp_compile": False,
        "allow_all_ops_in_lx_planning": False,
        "dxp_lx_frac_avail": 0.2,
        "sencores": 32,
        "max_buckets": 32,
        "min_default_granularity": 4,
        "ignore_work_division_hints": False,
        "read_copy_elision": True,
        "log_passes": "",
        "cost_model": "",
        "layout_solver": "cpsat",
        "validate_op_specs": True,
        "spyre_kernel_cache": False,
    }

    def __getattr__(self, name: str) -> Any:
        if name == "sencores":
            from torch_spyre.kernels import options

            return options.current().cores or self.DEFAULTS["sencores"]
        values = self.__dict__.setdefault("_values", dict(self.DEFAULTS))
        if name in values:
            return values[name]
        raise AttributeError(f"torch_spyre._inductor.config has no option {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):
            super().__setattr__(name, value)
        elif name == "sencores":
            from torch_spyre.kernels import options

            options.configure(cores=None if value is None else int(value))
        else:
            self.__dict__.setdefault("_values", dict(self.DEFAULTS))[name] = value

    @contextlib.contextmanager
    def patch(self, changes: dict[str, Any] | None = None, **kw: Any) -> Iterator[None]:
        from torch_spyre.kernels import options

        changes = {**(changes or {}), **kw}
        old = {k: options.current().cores if k == "sencores" else getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self, k, v)


#: the decompositions our backend adds to Inductor's own table: none (our
#: lowering takes Inductor's decomposed graph as it is)
spyre_decompositions: dict = {}

CONSTANTS: dict[str, Any] = {
    "DEVICE_NAME": "spyre",
    "BYTES_IN_STICK": STICK_BYTES,
    "FP8_E4M3FN_INFO": torch.finfo(torch.float8_e4m3fn),
    "FP8_E4M3FN_MAX": float(torch.finfo(torch.float8_e4m3fn).max),
    "FP8_E4M3FN_MIN": float(torch.finfo(torch.float8_e4m3fn).min),
}
