"""Which OpInfo entries are run: the universe, the --quick subset, the variants."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from torch_spyre.tools.opcheck.samples import sample_inputs

DEFAULT_DTYPES = (torch.float32, torch.float16)

# Families outside the universe (issue 4): they need float64/complex or are
# library surfaces of their own, measured separately if ever.
EXCLUDED_FAMILIES = ("linalg", "fft", "special", "sparse")


# The --quick subset: representative ops of every group issue 4 asks for
# (pointwise, reductions, matmul, normalisations, shape ops, factories,
# random) plus views, sort-based ops and integer division.
QUICK_OPS = (
    "add",
    "sub",
    "mul",
    "div[no_rounding_mode]",
    "floor_divide",
    "pow",
    "exp",
    "log",
    "sin",
    "tanh",
    "sigmoid",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.silu",
    "where",
    "clamp",
    "masked_fill",
    "eq",
    "logical_and",
    "half",
    "sum",
    "mean",
    "amax",
    "max[reduction_with_dim]",
    "argmax",
    "prod",
    "var",
    "any",
    "mm",
    "bmm",
    "addmm",
    "nn.functional.linear",
    "matmul",
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.rms_norm",
    "nn.functional.group_norm",
    "cat",
    "stack",
    "nn.functional.pad[constant]",
    "expand",
    "repeat",
    "index_select",
    "gather",
    "scatter",
    "nn.functional.embedding",
    "tril",
    "flip",
    "roll",
    "cumsum",
    "topk",
    "sort",
    "view",
    "transpose",
    "zeros_like",
    "full",
    "arange",
    "rand_like",
    "nn.functional.dropout",
    "empty_like",
    "resize_",
)
QUICK_MAX_SAMPLES = 3


def op_key(op: Any) -> str:
    return f"{op.name}[{op.variant_test_name}]" if op.variant_test_name else op.name


def load_op_db() -> list[Any]:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ModuleNotFoundError as e:
        if e.name != "expecttest":
            raise
        raise ModuleNotFoundError(
            "PyTorch's OpInfo database imports `expecttest`, which the torch wheel does not "
            "install: pip install expecttest (it is in the `test` extra)",
            name=e.name,
        ) from e

    return list(op_db)


def in_universe(op: Any, dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES) -> bool:
    if op.name.split(".")[0] in EXCLUDED_FAMILIES:
        return False
    supported = op.supported_dtypes("cpu")
    return any(d in supported for d in dtypes)


class InplaceVariant:
    """An OpInfo entry seen through its in-place variant (``x.add_(y)``), for --variant inplace."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.name = f"{op.name}_"
        self.variant_test_name = op.variant_test_name
        self.aten_name = getattr(op, "aten_name", op.name)

    def supported_dtypes(self, device_type: str) -> Any:
        return self.op.supported_dtypes(device_type)

    def sample_inputs(self, device: str, dtype: torch.dtype) -> Any:
        return sample_inputs(self.op, dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op.inplace_variant(*args, **kwargs)


class NoncontiguousVariant:
    """An OpInfo entry with every sample made non-contiguous (same values), for --variant."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.name = op.name
        self.variant_test_name = op.variant_test_name
        self.aten_name = getattr(op, "aten_name", op.name)

    def supported_dtypes(self, device_type: str) -> Any:
        return self.op.supported_dtypes(device_type)

    def sample_inputs(self, device: str, dtype: torch.dtype) -> Any:
        return (s.noncontiguous() for s in sample_inputs(self.op, dtype))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)


VARIANTS = ("function", "inplace", "noncontiguous")


def select_ops(
    ops: Iterable[Any],
    patterns: str | None = None,
    quick: bool = False,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    variant: str = "function",
) -> list[Any]:
    """The universe, optionally filtered by comma-separated regexes or the quick subset.

    A pattern must match a whole name, either ``name`` or ``name[variant]``.
    ``variant="inplace"`` gives the in-place variants of the ops that have one
    (named ``op_``) instead of the functions; ``"noncontiguous"`` the functions
    on non-contiguous copies of the samples (strided views over the card's
    stick layout).
    """
    chosen = [op for op in ops if in_universe(op, dtypes)]
    if variant == "inplace":
        chosen = [InplaceVariant(op) for op in chosen if op.inplace_variant is not None]
    elif variant == "noncontiguous":
        chosen = [NoncontiguousVariant(op) for op in chosen]
    elif variant != "function":
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if quick:
        chosen = [
            op for op in chosen if op_key(op if variant == "function" else op.op) in QUICK_OPS
        ]
    if patterns:
        regexes = [re.compile(p.strip()) for p in patterns.split(",") if p.strip()]
        chosen = [
            op
            for op in chosen
            if any(r.fullmatch(op.name) or r.fullmatch(op_key(op)) for r in regexes)
        ]
    return sorted(chosen, key=op_key)
