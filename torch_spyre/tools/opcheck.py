"""Op coverage of spyre, measured with PyTorch's OpInfo database.

Every sample input of every OpInfo entry in the universe (below) is generated
on the CPU, copied to spyre (tensors, nested ones included; ``cpu`` devices
become ``spyre``), run there and on the CPU, and the results are compared.
Each op is then classified by how spyre served it (``dispatch_stats``):

* ``device kernel``: every sample passed, and no adapter or host fallback ran
  (kernel programs, or metadata-only ops such as views that move no data);
* ``adapter``: every sample passed, some went through an adapter, none through
  the host fallback;
* ``host fallback``: every sample passed, some ran on the host;
* ``fails``: some sample raised or gave a different result;
* ``crash``: the worker process died (signal, abort) or hung; that is a bug,
  since every failure must be a Python exception.

Run ``python -m torch_spyre.tools.opcheck --help``.  A full run rewrites
docs/op-coverage.md; a filtered run (``--ops``/``--quick``) writes only where
``--output`` says, so a partial table never replaces the full one.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import re
import signal
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import torch_spyre
from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import TOLERANCE_NOTE, TOLERANCE_TABLE

DEVICE = "spyre"
DEFAULT_OUTPUT = Path("docs/op-coverage.md")
DEFAULT_DTYPES = (torch.float32, torch.float16)

# Families outside the universe (issue 4): they need float64/complex or are
# library surfaces of their own, measured separately if ever.
EXCLUDED_FAMILIES = ("linalg", "fft", "special", "sparse")

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

# A sample whose tensors hold more elements than this is skipped: the
# simulated card would take minutes on it and it adds nothing a smaller
# sample of the same op does not cover.  OpInfo samples are far below it.
MAX_SAMPLE_ELEMENTS = 1 << 24

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

# Paths of an op, best first.
KERNEL = "device kernel"
ADAPTER = "adapter"
FALLBACK = "host fallback"
FAILS = "fails"
CRASH = "crash"
EXCLUDED = "excluded"
PASSING = (KERNEL, ADAPTER, FALLBACK)
ORDER = (KERNEL, ADAPTER, FALLBACK, FAILS, CRASH)

ERROR_CHARS = 220


# --- results -----------------------------------------------------------------
@dataclass
class OpResult:
    """What the samples of one OpInfo entry did on spyre."""

    name: str
    variant: str = ""
    samples: int = 0  # samples run on spyre (passed + failed)
    passed: int = 0
    skipped: int = 0
    first_error: str = ""  # the first failure's message
    first_error_at: str = ""  # and its sample: dtype, index, arguments
    raised: int = 0  # failed samples whose op raised (rather than differed)
    raised_named: int = 0  # ... with a message naming the op and a shape
    skip_reasons: dict[str, int] = field(default_factory=dict)
    # path ("kernel"/"adapter"/"fallback") -> aten op -> calls
    dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    values_compared: bool = True
    crashed: str = ""
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    @property
    def first_failure(self) -> str:
        return (
            f"{self.first_error_at}: {self.first_error}"
            if self.first_error_at
            else self.first_error
        )

    @property
    def failed(self) -> int:
        return self.samples - self.passed

    @property
    def path(self) -> str:
        return classify(self)

    def record(self, outcome: SampleOutcome, where: str) -> None:
        if outcome.status == "skipped":
            self.skipped += 1
            self.skip_reasons[outcome.error] = self.skip_reasons.get(outcome.error, 0) + 1
            return
        self.samples += 1
        for (path, op), n in outcome.dispatch.items():
            per_op = self.dispatch.setdefault(path, {})
            per_op[op] = per_op.get(op, 0) + n
        if not outcome.values_compared:
            self.values_compared = False
        if outcome.status == "passed":
            self.passed += 1
            return
        if outcome.raised:
            self.raised += 1
            self.raised_named += outcome.named
        if not self.first_error:
            self.first_error = _truncate(outcome.error)
            self.first_error_at = where


def classify(result: OpResult) -> str:
    """The path of an op, from its sample counts and what dispatch_stats recorded."""
    if result.crashed:
        return CRASH
    if result.samples == 0:
        return EXCLUDED
    if result.passed < result.samples:
        return FAILS
    if result.dispatch.get("fallback"):
        return FALLBACK
    if result.dispatch.get("adapter"):
        return ADAPTER
    # only kernel calls, or none at all (views and other metadata-only ops)
    return KERNEL


@dataclass
class SampleOutcome:
    status: str  # "passed", "failed" or "skipped"
    error: str = ""  # why it failed, or why it was skipped
    dispatch: dict[tuple[str, str], int] = field(default_factory=dict)
    values_compared: bool = True
    raised: bool = False  # the op raised on spyre
    named: bool = False  # ... and the message names the op and a shape


# --- moving samples to the device ----------------------------------------------
class _NotRunnable(Exception):
    """The sample cannot run on spyre for a reason outside the op (dtype, size)."""


def _to_device(tree: Any, device: str, keep: frozenset[int] = frozenset()) -> tuple[Any, bool]:
    """``tree`` with every CPU tensor, device and generator moved to ``device``.

    Views keep their geometry over a moved base (so device views are tested,
    not contiguous copies), and a tensor passed twice stays one tensor, so
    aliasing between arguments is what it was on the CPU.  Tensors whose id
    is in ``keep`` stay where they are.
    """
    memo: dict[int, torch.Tensor] = {}
    moved = False

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        base = t._base
        if (
            base is not None
            and base.dtype == t.dtype
            and base.is_contiguous()
            and base.storage_offset() == 0
            and base.untyped_storage().nbytes() == base.numel() * base.element_size()
        ):
            if id(base) not in memo:
                memo[id(base)] = base.detach().to(device)
            out = memo[id(base)].as_strided(t.shape, t.stride(), t.storage_offset())
        else:
            out = t.detach().to(device)
        memo[id(t)] = out
        return out

    def convert(x: Any) -> Any:
        nonlocal moved
        if isinstance(x, torch.Tensor):
            if id(x) in keep:
                return x
            if (bad := _unsupported_tensor(x)) is not None:
                raise _NotRunnable(f"needs {bad}")
            moved = True
            return move(x)
        if isinstance(x, torch.device) and x.type == "cpu":
            moved = True
            return torch.device(device)
        if isinstance(x, str) and x == "cpu":
            moved = True
            return device
        if isinstance(x, torch.Generator) and x.device.type == "cpu":
            gen = torch.Generator(device=device)
            gen.set_state(x.get_state())
            return gen
        return x

    return tree_map(convert, tree), moved


def _numel(tree: Any) -> int:
    return sum(t.numel() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _unsupported_tensor(t: torch.Tensor) -> str | None:
    """Why spyre cannot hold ``t`` (its dtype or layout), or None."""
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} layout"
    if t.dtype not in torch_spyre.SUPPORTED_DTYPES:
        return str(t.dtype).removeprefix("torch.")
    return None


def _unsupported(tree: Any) -> str | None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and (bad := _unsupported_tensor(t)) is not None:
            return bad
    return None


def describe(tree: Any, limit: int = 160) -> str:
    """A short description of sample arguments: tensors as dtype[shape]."""

    def short(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).removeprefix("torch.")
            extra = "" if x.is_contiguous() else ",strided"
            return _Repr(f"{dt}{list(x.shape)}{extra}")
        return x

    text = repr(tree_map(short, tree))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Repr:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


# --- running and comparing -----------------------------------------------------
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


def _truncate(text: str, limit: int = ERROR_CHARS) -> str:
    # one line, and no object addresses: the report must not change between runs
    text = re.sub(r"0x[0-9a-fA-F]+", "0x..", " ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def sample_inputs(op: Any, dtype: torch.dtype) -> Iterator[Any]:
    """``op.sample_inputs("cpu", dtype)``: the same samples with the same values.

    OpInfo's own iterator (``TrackedInputIter``) looks for the unittest test
    that runs it with ``inspect.stack()`` on every sample set and item (~80 ms
    each with this many modules loaded: a third of a whole run), and seeds every
    generator with ``torch.manual_seed``, which queues a call with its formatted
    stack for each uninitialised CUDA-like device.  No test runs here, so it
    would seed every sample with ``SEED``: so do we, for the generators a
    sample reads (CPU, spyre, ``random``, NumPy).  Variants that expose no
    ``sample_inputs_func`` go through ``sample_inputs``.
    """
    func = getattr(op, "sample_inputs_func", None)
    if func is None:
        yield from op.sample_inputs("cpu", dtype)
        return
    from torch.testing._internal import common_utils

    def seed() -> None:
        torch.default_generator.manual_seed(common_utils.SEED)
        torch.spyre.manual_seed_all(common_utils.SEED)
        random.seed(common_utils.SEED)
        if common_utils.TEST_NUMPY:
            import numpy

            numpy.random.seed(common_utils.SEED)

    it = iter(func(op, "cpu", dtype, False))
    while True:
        seed()  # before every item, as OpInfo's iterator
        try:
            sample = next(it)
        except StopIteration:
            return
        yield sample


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


# --- selecting ops ---------------------------------------------------------------
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


# --- runners -------------------------------------------------------------------------
def _prepare_process(threads: int | None) -> None:
    torch_spyre.set_fallback_policy("silent")
    if threads is not None:
        torch.set_num_threads(threads)


def run_in_process(
    ops: Sequence[Any],
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_samples: int | None = None,
    progress: Callable[[OpResult, int, int], None] | None = None,
) -> list[OpResult]:
    """Run ``ops`` here, one after another (no protection against a crash)."""
    old = torch_spyre.get_fallback_policy()
    _prepare_process(None)
    results = []
    try:
        for i, op in enumerate(ops):
            results.append(run_op(op, dtypes, max_samples))
            if progress is not None:
                progress(results[-1], i + 1, len(ops))
    finally:
        torch_spyre.set_fallback_policy(old)
    return results


def _worker_main(
    conn: Connection, ops: Sequence[Any], dtypes: Sequence[torch.dtype], max_samples: int | None
) -> None:
    # one intra-op thread per worker: the workers already fill the cores
    _prepare_process(1)
    while True:
        index = conn.recv()
        if index is None:
            return
        result = run_op(
            ops[index], dtypes, max_samples, on_sample=lambda w: conn.send(("sample", w))
        )
        # a plain dict: under `python -m` the class lives in __main__, which
        # the parent cannot unpickle by name
        conn.send(("done", asdict(result)))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    index: int | None = None
    started: float = 0.0
    sample: str = ""


def _death(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_in_workers(
    ops: Sequence[Any],
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_samples: int | None = None,
    jobs: int = 2,
    timeout_s: float = 300.0,
    progress: Callable[[OpResult, int, int], None] | None = None,
) -> list[OpResult]:
    """Run ``ops`` in ``jobs`` forked worker processes, one op at a time each.

    Worker k runs ops k, k+jobs, k+2*jobs, ... in that order, whatever the
    timing: an op's result may depend on what ran before it in the same
    process (kernel caches, allocator state), and a fixed order keeps the
    report reproducible and such bugs reproducible with ``--jobs 1``.
    A worker that dies or runs one op longer than ``timeout_s`` is replaced
    and its op is reported as ``crash`` with the sample it was running.
    Forking (not spawning) keeps whatever this process loaded, the OpInfo
    database included, and works for ops defined at run time (tests).
    """
    ctx = multiprocessing.get_context("fork")
    jobs = max(1, min(jobs, len(ops)))
    results: dict[int, OpResult] = {}
    queues = [list(range(k, len(ops), jobs))[::-1] for k in range(jobs)]
    workers: dict[int, _Worker] = {}  # slot -> its live worker

    def spawn() -> _Worker:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, ops, dtypes, max_samples), daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def finish(index: int, result: OpResult) -> None:
        results[index] = result
        if progress is not None:
            progress(result, len(results), len(ops))

    def stop(slot: int) -> None:
        w = workers.pop(slot)
        w.conn.close()
        w.process.join(5)

    def crashed(slot: int, why: str) -> None:
        w = workers[slot]
        op = ops[w.index]
        res = OpResult(op.name, op.variant_test_name, crashed=f"worker {why}")
        res.first_error, res.first_error_at = res.crashed, w.sample
        res.seconds = time.monotonic() - w.started
        finish(w.index, res)
        stop(slot)

    try:
        while len(results) < len(ops):
            for slot, queue in enumerate(queues):
                w = workers.get(slot)
                if w is not None and w.index is None and not queue:
                    w.conn.send(None)  # nothing left for this slot
                    stop(slot)
                    continue
                if queue and (w is None or w.index is None):
                    if w is None:
                        w = workers[slot] = spawn()
                    w.index, w.started, w.sample = queue.pop(), time.monotonic(), ""
                    w.conn.send(w.index)
            ready = wait([w.conn for w in workers.values()], timeout=1.0)
            for slot, w in list(workers.items()):
                if w.conn in ready:
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError):
                        w.process.join(5)
                        crashed(slot, _death(w.process))
                        continue
                    if kind == "sample":
                        w.sample = payload
                    else:
                        finish(w.index, OpResult(**payload))
                        w.index = None
                elif time.monotonic() - w.started > timeout_s:
                    w.process.kill()
                    w.process.join(5)
                    crashed(slot, f"timed out after {timeout_s:.0f} s")
    finally:
        for w in workers.values():
            w.process.kill()
            w.process.join(5)
    return [results[i] for i in range(len(ops))]


# --- reporting -------------------------------------------------------------------------
@dataclass
class Totals:
    ops: int  # ops in the universe that ran at least one sample
    by_path: dict[str, int]
    samples: int
    samples_passed: int
    excluded: int
    raised: int = 0
    raised_named: int = 0

    @property
    def passing(self) -> int:
        return sum(self.by_path.get(p, 0) for p in PASSING)

    @property
    def on_device(self) -> int:
        return self.by_path.get(KERNEL, 0) + self.by_path.get(ADAPTER, 0)

    def pct(self, n: int) -> float:
        return 100.0 * n / self.ops if self.ops else 0.0


def totals(results: Sequence[OpResult]) -> Totals:
    ran = [r for r in results if r.path != EXCLUDED]
    return Totals(
        ops=len(ran),
        by_path=dict(Counter(r.path for r in ran)),
        samples=sum(r.samples for r in ran),
        samples_passed=sum(r.passed for r in ran),
        excluded=len(results) - len(ran),
        raised=sum(r.raised for r in ran),
        raised_named=sum(r.raised_named for r in ran),
    )


def _cause(error: str) -> str:
    """A failure's cause for grouping: the message without sample details and numbers."""
    text = re.sub(r"\[[^\]]*\]", "[..]", error)
    text = re.sub(r"'[^']*'", "'..'", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return _truncate(text, 110)


def failure_groups(results: Sequence[OpResult]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if r.path in (FAILS, CRASH):
            groups[_cause(r.first_error)].append(r.key)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def totals_lines(t: Totals) -> list[str]:
    return [
        f"ops in the universe: {t.ops} ({t.excluded} more OpInfo entries had no runnable sample)",
        f"passing on spyre: {t.passing} ({t.pct(t.passing):.1f}%)",
        f"passing on device kernels or adapters: {t.on_device} ({t.pct(t.on_device):.1f}%)",
        "by path: "
        + ", ".join(
            f"{p} {t.by_path.get(p, 0)} ({t.pct(t.by_path.get(p, 0)):.1f}%)" for p in ORDER
        ),
        f"samples: {t.samples}, passing {t.samples_passed}"
        + (f" ({100.0 * t.samples_passed / t.samples:.1f}%)" if t.samples else ""),
        f"failing samples that raised: {t.raised}, of which {t.raised_named} with a message "
        "naming the op and a shape",
    ]


def format_table(results: Sequence[OpResult]) -> str:
    rows = [("op", "variant", "samples", "passed", "skipped", "path", "first error")]
    for r in results:
        err = r.first_failure if r.path != EXCLUDED else _skip_summary(r)
        rows.append(
            (r.name, r.variant, str(r.samples), str(r.passed), str(r.skipped), r.path, err[:100])
        )
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = []
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:6], widths)]
        lines.append("  ".join(cells) + "  " + row[6])
    return "\n".join(line.rstrip() for line in lines)


def _skip_summary(r: OpResult) -> str:
    return "; ".join(f"{why} ({n})" for why, n in sorted(r.skip_reasons.items()))


def _host_ops(results: Sequence[OpResult]) -> Counter[str]:
    """aten op -> number of OpInfo ops that reached it through the host fallback."""
    used: Counter[str] = Counter()
    for r in results:
        for aten in r.dispatch.get("fallback", {}):
            used[aten] += 1
    return used


def render_markdown(results: Sequence[OpResult], dtypes: Sequence[torch.dtype]) -> str:
    t = totals(results)
    ran = [r for r in results if r.path != EXCLUDED]
    excluded = [r for r in results if r.path == EXCLUDED]
    dts = ", ".join(_short_dtype(d) for d in dtypes)
    out = [
        "# Op coverage on spyre",
        "",
        "<!-- generated by `python -m torch_spyre.tools.opcheck`; do not edit, rerun the tool -->",
        "",
        "Every sample input of PyTorch's OpInfo database "
        "(`torch.testing._internal.common_methods_invocations.op_db`, "
        f"torch {torch.__version__.split('+')[0]}) is run on spyre and on the CPU for "
        f"{dts}, and the results are compared. Regenerate with "
        "`python -m torch_spyre.tools.opcheck` (a few minutes; `--help` for filters).",
        "",
        "## Totals",
        "",
        *[f"- {line}" for line in totals_lines(t)],
        "",
        "## How it is measured",
        "",
        "- **Universe**: every OpInfo entry with float32 or float16 samples, except the "
        + ", ".join(f"`{f}.*`" for f in EXCLUDED_FAMILIES)
        + " families. Samples that need a dtype spyre does not store (float64, complex) "
        "in their inputs or in the CPU result, samples the CPU itself rejects, and samples "
        f"over {MAX_SAMPLE_ELEMENTS} elements are skipped (counted per op); an entry left "
        "with no runnable sample is listed under *Excluded*.",
        "- **Samples** are generated on the CPU (seeded) and copied to spyre, views as "
        "views over a copied base; `cpu` devices and generators become `spyre` ones. "
        "The op runs on both; outputs must match in structure, shape, dtype, device and "
        "values; an output must alias an argument on spyre exactly when it does on the CPU; "
        "and arguments must hold the same values afterwards (in-place writes).",
        "- **Paths**: *device kernel*: every sample passed and spyre recorded only kernel "
        "calls (or none: views and other metadata-only ops); *adapter*: every sample "
        "passed, some through an adapter, none on the host; *host fallback*: every sample "
        "passed, some on the host; *fails*: a sample raised or differed; *crash*: the "
        "process died or hung (a bug: every failure must be a Python exception).",
        "",
        "### Tolerances",
        "",
        TOLERANCE_NOTE.rstrip(),
        "",
        "| dtype | rtol | atol |",
        "|---|---|---|",
        *[f"| {_short_dtype(d)} | {TOLERANCES[d][0]:g} | {TOLERANCES[d][1]:g} |" for d in dtypes],
        "",
    ]
    groups = failure_groups(results)
    if groups:
        out += ["## Failures by cause", "", "| ops | cause | which |", "|---|---|---|"]
        for cause, keys in groups.items():
            out.append(f"| {len(keys)} | {_md(cause)} | {', '.join(keys)} |")
        out.append("")
    host = _host_ops(results)
    if host:
        out += [
            "## aten ops served by the host fallback",
            "",
            "Each with the number of OpInfo ops that reached it.",
            "",
            ", ".join(
                f"`{aten}` {n}" for aten, n in sorted(host.items(), key=lambda kv: (-kv[1], kv[0]))
            ),
            "",
        ]
    out += [
        "## Ops",
        "",
        "| op | variant | samples | passed | skipped | path | first error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ran:
        flag = "" if r.values_compared else " (values random, not compared)"
        out.append(
            f"| {r.name} | {r.variant} | {r.samples} | {r.passed} | {r.skipped} | "
            f"{r.path}{flag} | {_md(_truncate(r.first_failure, 300))} |"
        )
    out.append("")
    if excluded:
        out += ["## Excluded (no runnable sample)", "", "| op | variant | why |", "|---|---|---|"]
        for r in excluded:
            out.append(f"| {r.name} | {r.variant} | {_md(_skip_summary(r))} |")
        out.append("")
    return "\n".join(out)


# --- command line ----------------------------------------------------------------------
_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtypes(text: str) -> list[torch.dtype]:
    out = []
    for name in text.split(","):
        name = name.strip().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {name!r}; use {', '.join(sorted(_DTYPE_NAMES))}"
            )
        out.append(_DTYPE_NAMES[name])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_spyre.tools.opcheck",
        description="Run PyTorch's OpInfo samples on spyre and on the CPU, compare, and "
        "report per op whether it runs as a device kernel, an adapter, the host fallback, "
        "or fails.",
    )
    p.add_argument(
        "--ops",
        help="comma-separated regexes; an op is kept if one matches its whole name or "
        "name[variant], e.g. 'add,nn\\.functional\\..*,max\\[binary\\]'",
    )
    p.add_argument(
        "--dtypes",
        type=parse_dtypes,
        default=list(DEFAULT_DTYPES),
        help="comma-separated dtypes (default: float32,float16)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a fast subset: {len(QUICK_OPS)} representative ops, "
        f"{QUICK_MAX_SAMPLES} samples per dtype",
    )
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="function",
        help="what to run: the op on its samples (default; the one the report and its "
        "totals are about), its in-place variant x.op_(...) for ops that have one, or the op "
        "on non-contiguous copies of the samples",
    )
    p.add_argument("--max-samples", type=int, help="at most this many samples per op and dtype")
    p.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="worker processes (default 2); 0 runs in this process without crash protection",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one op may take (default 300)"
    )
    p.add_argument(
        "--output",
        type=Path,
        help=f"markdown report (default: {DEFAULT_OUTPUT} for a full run; "
        "filtered runs write one only when asked)",
    )
    p.add_argument("--json", type=Path, help="also write every result as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-op progress lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    ops = select_ops(load_op_db(), args.ops, args.quick, args.dtypes, args.variant)
    if not ops:
        print("no op matches", file=sys.stderr)
        return 2
    max_samples = args.max_samples or (QUICK_MAX_SAMPLES if args.quick else None)

    def progress(r: OpResult, done: int, total: int) -> None:
        if not args.quiet:
            print(
                f"[{done}/{total}] {r.key}: {r.path} {r.passed}/{r.samples} ({r.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    if args.jobs == 0:
        results = run_in_process(ops, args.dtypes, max_samples, progress)
    else:
        results = run_in_workers(ops, args.dtypes, max_samples, args.jobs, args.timeout, progress)
    elapsed = time.perf_counter() - start

    print(format_table(results))
    print()
    groups = failure_groups(results)
    if groups:
        print("failures by cause:")
        for cause, keys in groups.items():
            print(f"  {len(keys):3d}  {cause}\n       {', '.join(keys)}")
        print()
    for line in totals_lines(totals(results)):
        print(line)
    print(f"time: {elapsed:.1f} s for {len(ops)} ops")

    output = args.output
    # only the full, default run replaces the checked-in report
    full = not (args.ops or args.quick or args.max_samples) and args.variant == "function"
    if output is None and full and tuple(args.dtypes) == DEFAULT_DTYPES:
        output = DEFAULT_OUTPUT
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(render_markdown(results, args.dtypes))
        print(f"wrote {output}")
    if args.json is not None:
        data = [asdict(r) | {"key": r.key, "path": r.path} for r in results]
        args.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
