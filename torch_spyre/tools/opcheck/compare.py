"""One sample on spyre and on the CPU, and the comparison of the two."""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import TOLERANCE_TABLE
from torch_spyre.tools.opcheck.results import OpResult, SampleOutcome
from torch_spyre.tools.opcheck.samples import (
    _NotRunnable,
    _numel,
    _to_device,
    _unsupported,
    describe,
    sample_inputs,
)
from torch_spyre.tools.opcheck.selection import DEFAULT_DTYPES

DEVICE = "spyre"

# tolerances are chosen (and justified) in one place: torch_spyre.testing
TOLERANCES = TOLERANCE_TABLE

# Outputs that are uninitialized memory on every device: only their
# metadata is comparable.
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)
# Arguments (positions in (input, *args)) that PyTorch's API wants on the
# host whatever the device of the other tensors; moving them to spyre would
# test the tool, not the op.
HOST_ARGUMENTS: dict[str, tuple[int, ...]] = {
    # tensor_indices_or_sections "must be on cpu" (the same on CUDA)
    "tensor_split": (1,),
}
# resize_ keeps the first elements and leaves the grown part uninitialized:
# compare the kept prefix only.
RESIZE_OPS = frozenset({"resize_", "resize_as_"})

# Ops whose CPU kernel rounds intermediates to fp16: the CPU's transposed
# convolution (slow_conv_transpose: a GEMM into fp16 columns, then col2im
# adding the overlapping columns in fp16) strays several ulps of its
# intermediates (~1e-1 at OpInfo's magnitudes of a few hundred) from the
# correctly rounded result, beyond the fp16 tolerance of its own result.
# Their fp16 reference is the op computed in fp32 and rounded once (the
# device sums in fp32 and rounds once; measured on every sample: the device is
# within tolerance of that, the fp16 CPU is not on 10 of them).
FP16_REFERENCE_IN_FP32 = frozenset(
    {"nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
     "nn.functional.conv_transpose3d"}
)  # fmt: skip

# A sample whose tensors hold more elements than this is skipped: the
# simulated card would take minutes on it and it adds nothing a smaller
# sample of the same op does not cover.  OpInfo samples are far below it.
MAX_SAMPLE_ELEMENTS = 1 << 24


class _Recorder(TorchDispatchMode):
    """What the CPU reference did inside: random draws, dtypes spyre cannot store."""

    def __init__(self) -> None:
        super().__init__()
        self.seeded = False
        self.unsupported: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded = True
        out = func(*args, **(kwargs or {}))
        if (bad := _unsupported(out)) is not None:
            self.unsupported.add(bad)
        return out


def _error_text(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {'; '.join(lines)}"


def _compare(
    actual: Any, expected: Any, tol: tuple[float, float], values: bool, where: str
) -> None:
    """Raise AssertionError, naming ``where``, unless ``actual`` (spyre) matches ``expected``."""
    rtol, atol = tol
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        if actual.device.type != DEVICE:
            raise AssertionError(f"{where}: on {actual.device}, expected a {DEVICE} tensor")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(
                f"{where}: {actual.dtype}{list(actual.shape)} on spyre, "
                f"{expected.dtype}{list(expected.shape)} on cpu"
            )
        host = actual.cpu()
        if values:
            try:
                torch.testing.assert_close(host, expected, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"{where}: expected {_kind(expected)}, got {_kind(actual)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, tol, values, f"{where}[{i}]")
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise AssertionError(f"{where}: expected {_kind(expected)}, got {_kind(actual)}")
        for k in expected:
            _compare(actual[k], expected[k], tol, values, f"{where}[{k!r}]")
        return
    if isinstance(expected, float) and isinstance(actual, float):
        if not values or (math.isnan(expected) and math.isnan(actual)):
            return
        if not math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol):
            raise AssertionError(f"{where}: {actual!r} on spyre, {expected!r} on cpu")
        return
    if type(actual) is not type(expected) or (values and actual != expected):
        raise AssertionError(f"{where}: {actual!r} on spyre, {expected!r} on cpu")


def _kind(x: Any) -> str:
    if isinstance(x, (list, tuple, dict)):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__


def _storage_id(t: torch.Tensor) -> int | None:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _check_aliasing(sp_in: Any, sp_out: Any, cpu_in: Any, cpu_out: Any) -> None:
    """An output must alias an input on spyre exactly when it does on the CPU.

    A copy where PyTorch returns a view loses writes through the view; a view
    where it returns a new tensor leaks writes into the input.
    """

    def owners(tree: Any) -> dict[int, int]:
        ids: dict[int, int] = {}
        for i, t in enumerate(tree_flatten(tree)[0]):
            if isinstance(t, torch.Tensor) and (sid := _storage_id(t)) is not None:
                ids.setdefault(sid, i)
        return ids

    cpu_owner, sp_owner = owners(cpu_in), owners(sp_in)
    cpu_leaves, sp_leaves = tree_flatten(cpu_out)[0], tree_flatten(sp_out)[0]
    for i, (c, s) in enumerate(zip(cpu_leaves, sp_leaves)):
        if not (isinstance(c, torch.Tensor) and isinstance(s, torch.Tensor)):
            continue
        cid, sid = _storage_id(c), _storage_id(s)
        if cid is None or sid is None:
            continue
        want, got = cpu_owner.get(cid), sp_owner.get(sid)
        if want != got:
            where = f"output {i}" if len(cpu_leaves) > 1 else "output"
            want_s = "a new tensor" if want is None else f"a view of argument {want}"
            got_s = "a new tensor" if got is None else f"a view of argument {got}"
            raise AssertionError(f"{where}: {got_s} on spyre, {want_s} on cpu")


def _dim_arg(position: int, default: int | None) -> Callable[[tuple, dict], int | None]:
    def get(args: tuple, kwargs: dict) -> int | None:
        return args[position] if len(args) > position else kwargs.get("dim", default)

    return get


# Ops that select elements and return their indices, where PyTorch leaves the
# index of equal values unspecified (topk, kthvalue, median and mode say so;
# sort and argsort unless stable=True): the indices may differ from the CPU's
# only where they point at equal values.  The lambda finds the dim, from
# (input, *args) and kwargs.
TIE_ORDER_UNSPECIFIED: dict[str, Callable[[tuple, dict], int | None]] = {
    "topk": _dim_arg(2, -1),
    "kthvalue": _dim_arg(2, -1),
    "sort": _dim_arg(1, -1),
    "argsort": _dim_arg(1, -1),
    "median": _dim_arg(1, None),
    "nanmedian": _dim_arg(1, None),
    "mode": _dim_arg(1, -1),
}


def _compare_selection(
    name: str, args: tuple, kwargs: dict, actual: Any, expected: Any, tol: tuple[float, float]
) -> None:
    """Compare a selection op's values, and its indices up to ties (TIE_ORDER_UNSPECIFIED)."""
    try:
        _compare(actual, expected, tol, True, "output")
        return
    except AssertionError:
        dim = TIE_ORDER_UNSPECIFIED[name](args, kwargs)
        if dim is None or kwargs.get("stable") or not isinstance(args[0], torch.Tensor):
            raise
    if name == "argsort":
        got, want = actual, expected
    else:
        if not (isinstance(actual, tuple) and len(actual) == 2 and len(expected) == 2):
            raise AssertionError(f"output: expected (values, indices), got {_kind(actual)}")
        _compare(actual[0], expected[0], tol, True, "output[0]")
        got, want = actual[1], expected[1]
    _compare(got, want, tol, False, "indices")  # structure, shape, dtype, device
    x, got = args[0], got.cpu()
    if got.dim() < x.dim():  # keepdim=False
        got, want = got.unsqueeze(dim), want.unsqueeze(dim)
    try:
        torch.testing.assert_close(
            x.gather(dim, got), x.gather(dim, want), rtol=0, atol=0, equal_nan=True
        )
    except AssertionError as e:
        raise AssertionError(f"indices point at other values than on cpu: {e}") from None


def _compare_arguments(sp: Any, cpu: Any, tol: tuple[float, float], values: bool) -> None:
    """In-place ops and ops that write into arguments: the writes must match."""
    for i, (s, c) in enumerate(zip(tree_flatten(sp)[0], tree_flatten(cpu)[0])):
        if isinstance(c, torch.Tensor) and s is not c:  # (not a kept host argument)
            _compare(s, c, tol, values, f"argument {i} after the op")


# shapes as messages write them: [4, 3], (4, 3), (4,), [], torch.Size([4, 3]), 4x3
_BRACKETED = re.compile(r"[\[(]\s*(\d+(?:\s*,\s*\d+)*)?\s*,?\s*[\])]")
_CROSSED = re.compile(r"\b\d+(?:x\d+)+\b")


def _shapes_in(text: str) -> set[tuple[int, ...]]:
    found = {
        tuple(int(d) for d in m.group(1).split(",")) if m.group(1) else ()
        for m in _BRACKETED.finditer(text)
    }
    found |= {tuple(int(d) for d in m.group(0).split("x")) for m in _CROSSED.finditer(text)}
    return found


def _fp32(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float16 else t


def _fp16(t):
    return t.half() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def _names_op_and_shape(message: str, op: Any, sample: Any) -> bool:
    """Does an error message say which op failed and on which shapes (design brief)?"""
    text = message.lower()
    names = {op.name.split(".")[-1], op.name, getattr(op, "aten_name", None) or op.name}
    if not any(n.lower().strip("_") in text for n in names):
        return False
    shapes = {tuple(t.shape) for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)}
    return bool(shapes & _shapes_in(text))


def run_sample(op: Any, sample: Any, dtype: torch.dtype) -> SampleOutcome:
    """Run one OpInfo sample on the CPU and on spyre and compare everything."""
    cpu_args = (sample.input, *sample.args)
    cpu_kwargs = dict(sample.kwargs)
    if _numel((cpu_args, cpu_kwargs)) > MAX_SAMPLE_ELEMENTS:
        return SampleOutcome("skipped", f"over {MAX_SAMPLE_ELEMENTS} elements")
    keep = frozenset(
        id(cpu_args[i])
        for i in HOST_ARGUMENTS.get(op.name, ())
        if i < len(cpu_args) and isinstance(cpu_args[i], torch.Tensor)
    )
    try:
        (sp_args, sp_kwargs), moved = _to_device((cpu_args, cpu_kwargs), DEVICE, keep)
    except _NotRunnable as e:
        return SampleOutcome("skipped", str(e))
    except Exception as e:  # copying a sample to the card must not fail: that is a bug
        return SampleOutcome("failed", f"copying the sample to spyre: {_error_text(e)}")
    if not moved:
        return SampleOutcome("skipped", "no tensor or device to put on spyre")
    resize_prefix = sample.input.numel() if op.name in RESIZE_OPS else None

    # The CPU reference runs first so samples it rejects cost nothing on spyre.
    recorder = _Recorder()
    try:
        with torch.no_grad(), recorder:
            expected = op(*cpu_args, **cpu_kwargs)
            if dtype == torch.float16 and op.name in FP16_REFERENCE_IN_FP32:
                up = tree_map(_fp32, (cpu_args, cpu_kwargs))
                expected = tree_map(_fp16, op(*up[0], **up[1]))
    except Exception as e:
        return SampleOutcome("skipped", f"CPU reference raises {type(e).__name__}")
    if (bad := _unsupported(expected)) is not None:
        return SampleOutcome("skipped", f"needs {bad}")

    # counts since now, without resetting the process-wide ones (the profiler's)
    before = dispatch_stats.counts()

    def served() -> dict[tuple[str, str], int]:
        after = dispatch_stats.counts()
        return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}

    try:
        with torch.no_grad():
            actual = op(*sp_args, **sp_kwargs)
    except Exception as e:
        # (the C++ allocator raises a plain TypeError, the layout code an
        # UnsupportedDtypeError: both say "does not store")
        if isinstance(e, TypeError) and "does not store" in str(e) and recorder.unsupported:
            # the CPU computes this op through complex/float64 intermediates
            # (stft, pinverse): the op needs a dtype spyre does not store
            inside = ", ".join(sorted(recorder.unsupported))
            return SampleOutcome("skipped", f"needs {inside} inside the op")
        named = _names_op_and_shape(str(e), op, (cpu_args, cpu_kwargs))
        return SampleOutcome("failed", _error_text(e), served(), raised=True, named=named)
    # what served the op, before the comparison's own copies run
    paths = served()
    values = not recorder.seeded and op.name not in UNINITIALIZED
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    try:
        if resize_prefix is not None:
            _compare(actual, expected, tol, False, "output")
            n = min(resize_prefix, expected.numel())
            _compare(actual.reshape(-1)[:n], expected.reshape(-1)[:n], tol, True, "kept values")
        elif op.name in TIE_ORDER_UNSPECIFIED and values:
            _compare_selection(op.name, cpu_args, cpu_kwargs, actual, expected, tol)
        else:
            _compare(actual, expected, tol, values, "output")
        _check_aliasing(sp_args + (sp_kwargs,), actual, cpu_args + (cpu_kwargs,), expected)
        # in-place ops and ops that write into arguments: the writes must match
        _compare_arguments(
            (sp_args, sp_kwargs), (cpu_args, cpu_kwargs), tol, values and resize_prefix is None
        )
    except AssertionError as e:
        return SampleOutcome("failed", str(e), paths, values)
    except Exception as e:  # reading results back raised
        return SampleOutcome("failed", f"reading the result: {_error_text(e)}", paths, values)
    return SampleOutcome("passed", "", paths, values)


def _short_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


SampleHook = Callable[[str], None]


def run_op(
    op: Any,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_samples: int | None = None,
    on_sample: SampleHook | None = None,
) -> OpResult:
    """Run every sample of OpInfo ``op`` for each dtype; never raises for the op's failures."""
    result = OpResult(op.name, op.variant_test_name)
    start = time.perf_counter()
    supported = op.supported_dtypes("cpu")
    with warnings.catch_warnings():
        # ops warn about deprecations and the like; the report is the output
        warnings.simplefilter("ignore")
        for dtype in dtypes:
            if dtype not in supported:
                continue
            # the same samples on every run, whatever ran before in this process
            torch.manual_seed(0)
            try:
                samples = list(islice(sample_inputs(op, dtype), max_samples))
            except Exception as e:
                result.record(
                    SampleOutcome("skipped", f"sample generation raises {type(e).__name__}"), ""
                )
                continue
            for i, sample in enumerate(samples):
                where = f"{_short_dtype(dtype)} sample {i} " + describe(
                    ((sample.input, *sample.args), sample.kwargs)
                )
                if on_sample is not None:
                    on_sample(where)
                result.record(run_sample(op, sample, dtype), where)
    result.seconds = time.perf_counter() - start
    return result
