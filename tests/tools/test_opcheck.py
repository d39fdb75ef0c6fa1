"""The op-coverage tool: its quick subset runs, and it classifies ops correctly.

The full OpInfo run is not a unit test (minutes); ``python -m
torch_spyre.tools.opcheck`` regenerates docs/op-coverage.md.
"""

from __future__ import annotations

import faulthandler
import os
import time
from typing import Any

import pytest
import torch

import torch_spyre
from torch_spyre.runtime import dispatch_stats
from torch_spyre.tools import opcheck
from torch_spyre.tools.opcheck import OpResult, classify

# --- fake OpInfo entries: exactly the surface the tool uses ----------------------


class _Sample:
    def __init__(self, input: Any, *args: Any, **kwargs: Any) -> None:
        self.input, self.args, self.kwargs = input, args, kwargs


class FakeOp:
    """A stand-in OpInfo: name, dtypes, samples, call."""

    def __init__(self, name: str, fn, samples=None, dtypes=(torch.float32,)) -> None:
        self.name, self.variant_test_name, self.aten_name = name, "", name
        self._fn, self._dtypes = fn, dtypes
        self._samples = samples or (lambda dtype: [_Sample(torch.randn(4, 3, dtype=dtype))])

    def supported_dtypes(self, device_type: str):
        return set(self._dtypes)

    def sample_inputs(self, device: str, dtype: torch.dtype):
        return iter(self._samples(dtype))

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


def _on_spyre(x: torch.Tensor) -> bool:
    return x.device.type == "spyre"


# A custom op with only a CPU kernel: on spyre it can only be served by the
# host fallback, whatever kernels the project grows.
@torch.library.custom_op("opcheck_test::host_only", mutates_args=(), device_types="cpu")
def _host_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _run(op: FakeOp) -> OpResult:
    [result] = opcheck.run_in_process([op])
    return result


# --- the quick subset, in this process ----------------------------------------------


@pytest.fixture(scope="module")
def quick_results() -> list[OpResult]:
    ops = opcheck.select_ops(opcheck.load_op_db(), quick=True)
    return opcheck.run_in_process(ops, max_samples=opcheck.QUICK_MAX_SAMPLES)


def test_quick_subset_gives_a_result_per_op(quick_results):
    keys = [r.key for r in quick_results]
    assert sorted(keys) == sorted(opcheck.QUICK_OPS)
    for r in quick_results:
        # every quick op has runnable samples and nothing took the process down
        assert r.path not in (opcheck.CRASH, opcheck.EXCLUDED), (r.key, r.first_failure)
        assert r.samples > 0 and r.passed + r.failed == r.samples
        assert r.path in opcheck.ORDER


def test_quick_classification_agrees_with_dispatch_stats(quick_results):
    for r in quick_results:
        if r.passed < r.samples:
            assert r.path == opcheck.FAILS and r.first_error, r.key
        elif r.dispatch.get("fallback"):
            assert r.path == opcheck.FALLBACK, r.key
        elif r.dispatch.get("adapter"):
            assert r.path == opcheck.ADAPTER, r.key
        else:
            assert r.path == opcheck.KERNEL, r.key


def test_quick_random_and_uninitialized_ops_compare_metadata_only(quick_results):
    by_key = {r.key: r for r in quick_results}
    for key in ("rand_like", "nn.functional.dropout", "empty_like"):
        assert not by_key[key].values_compared, key
    assert by_key["add"].values_compared


def test_report_renders(quick_results, tmp_path):
    text = opcheck.render_markdown(quick_results, opcheck.DEFAULT_DTYPES)
    assert text.startswith("# Op coverage on spyre")
    assert "eps = 2^-10" in text  # the tolerance justification travels with the numbers
    assert "passing on device kernels or adapters" in text
    for r in quick_results:
        assert f"| {r.name} | {r.variant} |" in text
    table = opcheck.format_table(quick_results)
    assert table.splitlines()[0].split()[:6] == ["op", "variant", "samples", "passed"] + [
        "skipped",
        "path",
    ]


# --- classification -------------------------------------------------------------------


def _result(samples: int, passed: int, **dispatch: dict[str, int]) -> OpResult:
    return OpResult("fake", samples=samples, passed=passed, dispatch=dict(dispatch))


def test_classify_cases():
    assert classify(_result(3, 3, kernel={"add.Tensor": 3})) == opcheck.KERNEL
    assert classify(_result(2, 2)) == opcheck.KERNEL  # views: metadata only
    assert classify(_result(3, 3, kernel={"a": 1}, adapter={"sin": 3})) == opcheck.ADAPTER
    assert (
        classify(_result(3, 3, kernel={"a": 1}, adapter={"b": 1}, fallback={"c": 1}))
        == opcheck.FALLBACK
    )
    assert classify(_result(3, 2, kernel={"a": 3})) == opcheck.FAILS
    assert classify(_result(3, 2, fallback={"a": 3})) == opcheck.FAILS
    assert classify(_result(0, 0)) == opcheck.EXCLUDED
    crashed = _result(0, 0)
    crashed.crashed = "worker killed by SIGSEGV"
    assert classify(crashed) == opcheck.CRASH


def test_op_without_spyre_kernel_is_host_fallback():
    op = FakeOp("host_only", lambda x: torch.ops.opcheck_test.host_only(x))
    r = _run(op)
    assert r.path == opcheck.FALLBACK, r.first_failure
    assert r.passed == r.samples == 1
    assert any("host_only" in aten for aten in r.dispatch["fallback"])


def test_view_op_is_device_kernel():
    r = _run(FakeOp("t", lambda x: x.t()))
    assert r.path == opcheck.KERNEL and r.passed == 1 and not r.dispatch


def test_wrong_values_fail_with_the_mismatch():
    r = _run(FakeOp("off_by_one", lambda x: x + 1 if _on_spyre(x) else x.clone()))
    assert r.path == opcheck.FAILS and r.failed == 1
    assert "not close" in r.first_error and "fp32 sample 0" in r.first_error_at


def test_an_exception_fails_the_sample_only():
    def boom(x):
        if _on_spyre(x):
            raise RuntimeError("boom: spyre cannot")
        return x.clone()

    r = _run(FakeOp("boom", boom))
    assert r.path == opcheck.FAILS and r.first_error == "RuntimeError: boom: spyre cannot"
    assert r.raised == 1


def test_copy_instead_of_view_is_an_aliasing_failure():
    r = _run(FakeOp("flat", lambda x: x.reshape(-1).clone() if _on_spyre(x) else x.view(-1)))
    assert r.path == opcheck.FAILS
    assert "a new tensor on spyre, a view of argument 0 on cpu" in r.first_error


def test_unwritten_argument_fails():
    # an op that writes into its argument, and whose write does not reach the device
    def lost_write(x):
        if not _on_spyre(x):
            x.mul_(2)

    r = _run(FakeOp("lost_write", lost_write))
    assert r.path == opcheck.FAILS
    assert r.first_error.startswith("argument 0 after the op: Tensor-likes are not close")


def test_random_values_are_not_compared():
    r = _run(FakeOp("noise", lambda x: torch.rand_like(x) + x))
    assert r.path != opcheck.FAILS, r.first_failure
    assert not r.values_compared


def test_unsupported_dtype_samples_are_skipped():
    samples = lambda dtype: [  # noqa: E731
        _Sample(torch.randn(3, dtype=torch.float64)),
        _Sample(torch.randn(3, dtype=dtype)),
    ]
    r = _run(FakeOp("neg", torch.neg, samples))
    assert r.skipped == 1 and r.skip_reasons == {"needs float64": 1}
    assert r.samples == 1 and r.passed == 1


def test_fallback_policy_is_silent_during_the_run_and_restored():
    torch_spyre.set_fallback_policy("error")
    try:
        r = _run(FakeOp("host_only", lambda x: torch.ops.opcheck_test.host_only(x)))
        assert r.path == opcheck.FALLBACK
        assert torch_spyre.get_fallback_policy() == "error"
    finally:
        torch_spyre.set_fallback_policy("warn")


def test_process_wide_dispatch_counts_are_kept():
    # the tool counts per sample by difference: a profiler's counts survive it
    dispatch_stats.record("fallback", "opcheck_test.sentinel")
    _run(FakeOp("host_only", lambda x: torch.ops.opcheck_test.host_only(x)))
    counts = dispatch_stats.counts("fallback")
    assert counts["opcheck_test.sentinel"] == 1
    assert any("host_only" in k for k in counts)
    dispatch_stats.reset()


# --- crash isolation ------------------------------------------------------------------


def test_a_crash_is_reported_and_the_run_goes_on():
    def abort(x):
        if _on_spyre(x):
            faulthandler.disable()  # (in the worker only: no stack dump in the test log)
            os.abort()  # what a segfault in a kernel would look like
        return x.clone()

    ops = [FakeOp("aborts", abort), FakeOp("t", lambda x: x.t())]
    crashed, fine = opcheck.run_in_workers(ops, jobs=1, timeout_s=60)
    assert crashed.path == opcheck.CRASH
    assert "SIGABRT" in crashed.first_error and "fp32 sample 0" in crashed.first_error_at
    assert fine.path == opcheck.KERNEL and fine.passed == 1


def test_a_hung_op_is_killed_and_reported():
    def hang(x):
        if _on_spyre(x):
            time.sleep(60)
        return x.clone()

    [hung] = opcheck.run_in_workers([FakeOp("hangs", hang)], jobs=1, timeout_s=1)
    assert hung.path == opcheck.CRASH and "timed out after 1 s" in hung.first_error


def test_workers_give_the_same_results_as_in_process():
    ops = opcheck.select_ops(opcheck.load_op_db(), "add,nn\\.functional\\.relu,sum")
    assert [op.name for op in ops] == ["add", "nn.functional.relu", "sum"]
    here = opcheck.run_in_process(ops, max_samples=2)
    there = opcheck.run_in_workers(ops, max_samples=2, jobs=2)
    assert [(r.key, r.path, r.samples, r.passed) for r in here] == [
        (r.key, r.path, r.samples, r.passed) for r in there
    ]


# --- command line ---------------------------------------------------------------------


def test_cli_writes_report_only_where_asked(tmp_path, capsys):
    out = tmp_path / "cov.md"
    assert opcheck.main(["--ops", "neg", "--jobs", "0", "-q", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "passing on spyre: 1 (100.0%)" in printed or "fails" in printed
    assert "| neg |" in out.read_text()


def test_cli_parses_dtypes():
    assert opcheck.parse_dtypes("fp16,float32") == [torch.float16, torch.float32]
    with pytest.raises(Exception, match="unknown dtype"):
        opcheck.parse_dtypes("float64")


def test_universe_excludes_families():
    keys = {opcheck.op_key(op) for op in opcheck.select_ops(opcheck.load_op_db())}
    assert "add" in keys and "nn.functional.gelu" in keys
    assert not any(k.split(".")[0] in opcheck.EXCLUDED_FAMILIES for k in keys)


def test_inplace_variants_are_selectable():
    ops = opcheck.select_ops(opcheck.load_op_db(), "add_,mul_", variant="inplace")
    assert [op.name for op in ops] == ["add_", "mul_"]
    [r] = opcheck.run_in_process(ops[:1], max_samples=2)
    assert r.key == "add_" and r.samples == 4  # 2 per dtype


def test_error_messages_are_checked_for_op_and_shapes():
    op, x = FakeOp("cos", torch.cos), torch.randn(4, 3)
    named = (
        "spyre has no kernel for aten.cos (torch.float32[4, 3]@spyre:0) and the policy is 'error'"
    )
    assert opcheck.compare._names_op_and_shape(named, op, (x,))
    assert not opcheck.compare._names_op_and_shape(
        "kernel 'k': operand 'out' needs 12 elements", op, (x,)
    )
    assert not opcheck.compare._names_op_and_shape("cos failed", op, (x,))  # no shape


def test_noncontiguous_variant_keeps_views_on_the_device():
    [op] = opcheck.select_ops(opcheck.load_op_db(), "add", variant="noncontiguous")
    torch.manual_seed(0)
    sample = next(s for s in op.sample_inputs("cpu", torch.float32) if s.input.numel() > 1)
    assert not sample.input.is_contiguous()
    (moved, _), _ = opcheck.samples._to_device(
        ((sample.input, *sample.args), sample.kwargs), "spyre"
    )
    assert moved[0].device.type == "spyre" and moved[0].stride() == sample.input.stride()
    with pytest.raises(ValueError, match="variant"):
        opcheck.select_ops([], variant="sideways")


def test_selection_indices_may_differ_only_on_ties():
    x = torch.tensor([[3.0, 5.0, 5.0, 1.0]])
    samples = lambda dtype: [_Sample(x.to(dtype), 1, 1)]  # noqa: E731

    def topk_picking(index: int):
        def fn(t, k, dim):
            values, indices = torch.topk(t, k, dim)
            if _on_spyre(t):
                indices = torch.full_like(indices, index)
            return torch.return_types.topk((values, indices))

        return fn

    tie = _run(FakeOp("topk", topk_picking(2), samples))  # the other 5.0
    assert tie.path != opcheck.FAILS, tie.first_failure
    wrong = _run(FakeOp("topk", topk_picking(0), samples))  # the 3.0
    assert wrong.path == opcheck.FAILS
    assert "indices point at other values" in wrong.first_error
