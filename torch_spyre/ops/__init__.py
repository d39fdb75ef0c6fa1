"""Eager aten ops on spyre as kernel programs on the card (see dispatch.py)."""

from __future__ import annotations

import torch

_libs: list[torch.library.Library] = []


def register() -> None:
    if _libs:
        return
    from torch_spyre.ops import (  # noqa: F401  (importing declares the kernels)
        adapters,
        attention,
        complex_ops,
        composite,
        conv,
        counting,
        dispatch,
        losses,
        matmul,
        mlp,
        moe,
        nested,
        normalization,
        paged_attention,
        pooling,
        projections,
        quantized,
        recurrent,
        reductions,
        registry,
        routes,
        ssm,
        transformer,
    )
    from torch_spyre.runtime.registration import entry

    registry.register()  # the kernels the modules above declared
    attention.register()
    composite.register()
    quantized.register()
    recurrent.register()

    everything = torch.library.Library("_", "IMPL")
    everything.fallback(entry(dispatch.catch_all), "PrivateUse1")
    _libs.append(everything)
