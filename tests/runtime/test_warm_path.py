"""The C++ warm launch path of eager add/sub/mul/div (csrc/warm.cpp, "warm
elementwise launches") gives exactly what the Python path gives.

Every figure is compared with the path on and off: output values and device
bytes (padding included), the card's clock, kernel count and kernel time,
the C++ clock events read, dispatch statistics, kernel-cache counts and
trace records.  Calls it must not serve (views, broadcasting, mixed dtypes,
scalars, out=, custom layouts, profilers, timing-only runs) are shown to go
through Python, with the same results and errors.
"""

import contextlib

import pytest
import torch

from torch_spyre import _C
from torch_spyre.runtime import cards, dispatch_stats, launch
from torch_spyre.sim import timing_only, trace
from torch_spyre.sim.hostviews import VIEWS

OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
}


def served() -> int:
    return _C._warm_info()["served"]


@contextlib.contextmanager
def warm(on: bool):
    before = cards.warm_path(on)
    try:
        yield
    finally:
        cards.warm_path(before)


def _pair(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        a = torch.randn(shape, generator=g).to(dtype)
        b = torch.randn(shape, generator=g).to(dtype)
    else:
        a = torch.randint(-100, 100, shape, generator=g).to(dtype)
        b = torch.randint(1, 100, shape, generator=g).to(dtype)
    return a.to("spyre"), b.to("spyre")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole device block behind ``t`` (padding included)."""
    return _C._device_bytes(t).clone()


def _figures() -> dict:
    card = cards.card(0)
    return {
        "card": card.stats(),
        "clock_ps": round(torch.spyre.modelled_time_s() * 1e12),
        "kernel": dict(dispatch_stats.counts("kernel")),
        "cache": launch.cache_info(),
    }


def _delta(before: dict, after: dict) -> dict:
    kernel = {k: n - before["kernel"].get(k, 0) for k, n in after["kernel"].items()}
    return {
        "card": after["card"],  # absolute: the card is reset before each run
        "clock_ps": after["clock_ps"] - before["clock_ps"],
        "kernel": {k: n for k, n in kernel.items() if n},
        "hits": after["cache"]["hits"] - before["cache"]["hits"],
        "misses": after["cache"]["misses"] - before["cache"]["misses"],
    }


def _run(fn, on: bool):
    """``fn()`` from a reset card, with the warm path on or off: its outputs'
    device bytes, the figures it moved, and the C++ launches it took."""
    with warm(on):
        cards.card(0).reset()
        f0, s0 = _figures(), served()
        outs = fn()
        s1, f1 = served(), _figures()
    return [_bytes(o) for o in outs], _delta(f0, f1), s1 - s0


def _same(fn, expect_served: int | None = None):
    fn()  # both paths warm: their caches hold the calls
    off_bytes, off_figs, off_served = _run(fn, on=False)
    on_bytes, on_figs, on_served = _run(fn, on=True)
    assert off_served == 0
    if expect_served is not None:
        assert on_served == expect_served
    assert len(on_bytes) == len(off_bytes)
    for x, y in zip(on_bytes, off_bytes):
        assert torch.equal(x, y)  # bit for bit, padding included
    assert on_figs == off_figs
    return on_figs


# ------------------------------------------------------------ the mechanism
@pytest.mark.parametrize("name", ["add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor"])
def test_cpp_kernels_registered_for_privateuse1(name):
    # the C++ kernels; on a miss each delegates to PyTorch's composite kernel,
    # whose out= redispatch reaches the Python fallback (test below)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "PrivateUse1")
    table = torch._C._dispatch_dump_table(f"aten::{name}")
    entry = next(line for line in table.splitlines() if line.startswith("PrivateUse1:"))
    assert "csrc/warm.cpp" in entry  # the warm launches of torch_spyre._C


def test_miss_delegates_to_what_spyre_had_before():
    # a structured sibling with no kernel of ours shows what add & co had for
    # PrivateUse1 before: PyTorch's composite kernel, which the C++ calls on a miss
    table = torch._C._dispatch_dump_table("aten::atan2")
    entry = next(line for line in table.splitlines() if line.startswith("PrivateUse1:"))
    assert "CompositeExplicitAutogradNonFunctional" in entry


def test_cold_call_runs_in_python_then_warm_calls_in_cpp():
    launch.clear_cache()  # forgets the C++ entries too
    a, b = _pair((64, 64), torch.float16, seed=11)
    k0 = dispatch_stats.counts("kernel").get("add.out", 0)
    s0 = served()
    c0 = launch.cache_info()
    cold = a + b
    assert served() == s0  # Python: the composite kernel, add.out, the kernel cache
    assert launch.cache_info()["misses"] == c0["misses"] + 1
    assert dispatch_stats.counts("kernel")["add.out"] == k0 + 1
    for _ in range(3):
        hot = a + b
    assert served() == s0 + 3  # if this fails, the warm path is not reached
    assert dispatch_stats.counts("kernel")["add.out"] == k0 + 4
    assert launch.cache_info()["hits"] == c0["hits"] + 3
    assert torch.equal(_bytes(hot), _bytes(cold))
    assert torch.equal(hot.cpu(), a.cpu() + b.cpu())


def test_env_switch_turns_it_off(spyre_python):
    code = """
        import torch, torch_spyre
        from torch_spyre import _C
        a = torch.ones(64, 64, dtype=torch.float16, device="spyre")
        for _ in range(3):
            a + a
        print(_C._warm_info()["served"])
    """
    assert spyre_python(code, TORCH_SPYRE_WARM_PATH="0").stdout.split() == ["0"]
    assert spyre_python(code).stdout.split() == ["2"]


# ---------------------------------------------------------- same figures
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 64), (3, 70), (130,), (2, 5, 33)])
def test_values_and_figures_identical(op, dtype, shape):
    a, b = _pair(shape, dtype)
    fn = OPS[op]
    figs = _same(lambda: [fn(a, b) for _ in range(3)], expect_served=3)
    assert figs["card"]["kernels"] == 3


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int64])
def test_integer_values_identical(op, dtype):
    a, b = _pair((16, 40), dtype)
    _same(lambda: [OPS[op](a, b)], expect_served=1)


def test_special_values_identical():
    vals = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 6e-8, -6e-8, 65504.0, -65504.0, float("inf"), float("-inf"),
         float("nan"), 1e-4, 3.0, 0.1],
    )  # fmt: skip
    grid = torch.cartesian_prod(vals, vals)
    a = grid[:, 0].reshape(14, 14).half().to("spyre")
    b = grid[:, 1].reshape(14, 14).half().to("spyre")
    _same(lambda: [f(a, b) for f in OPS.values()], expect_served=4)
    for f in OPS.values():  # and the values are the CPU's, one rounding from fp32
        want = f(a.cpu().float(), b.cpu().float()).half()
        torch.testing.assert_close(f(a, b).cpu(), want, rtol=0, atol=0, equal_nan=True)


def test_clock_identical_mixed_with_python_launches_and_copies():
    a, b = _pair((64, 64), torch.float16)
    x = torch.randn(64, 64).half()

    def seq():
        outs = []
        for _ in range(4):
            c = a + b
            d = c * b
            e = d.exp()  # Python launch between C++ launches
            outs += [c, d, e, e - a, e / b]
            outs.append(x.to("spyre"))  # an h2d transfer
            _ = outs[-2].cpu()  # a d2h transfer
        return outs

    figs = _same(seq, expect_served=16)
    assert figs["card"]["kernels"] == 20
    assert figs["card"]["transfers"]["h2d"] == 4 and figs["card"]["transfers"]["d2h"] == 4


def test_long_runs_replay_exactly():
    # more launches than the C++ log holds unreplayed (then Python serves one
    # and replays it): the clock is still the same sum, addition by addition
    a, b = _pair((8, 8), torch.float16)
    c = _pair((8, 8), torch.float32)

    def seq():
        for i in range(70000):
            if i % 3 == 0:
                c[0] * c[1]
            else:
                a + b
        return [a + b]

    figs = _same(seq)
    assert figs["card"]["kernels"] == 70001


def test_events_read_the_same_clock():
    a, b = _pair((64, 64), torch.float16)

    def elapsed(on):
        with warm(on):
            a + b
            s, e = torch.Event(device="spyre", enable_timing=True), None
            e = torch.Event(device="spyre", enable_timing=True)
            s.record()
            for _ in range(5):
                a + b
            e.record()
            return s.elapsed_time(e)

    assert elapsed(True) == elapsed(False) > 0


def test_card_reset_drops_earlier_launches():
    a, b = _pair((64, 64), torch.float16)
    a + b
    s0 = served()
    a + b
    assert served() == s0 + 1
    cards.card(0).reset()
    assert cards.card(0).stats()["kernels"] == 0
    assert cards.card(0).clock_s == 0.0


# --------------------------------------------------------- records
def test_trace_records_identical_and_path_stands_aside():
    a, b = _pair((64, 64), torch.float16)
    a + b

    def records(on):
        got = []
        with warm(on):
            cards.card(0).reset()
            trace.add_listener(got.append)
            try:
                assert not _C._warm_info()["allowed"]
                s0 = served()
                for _ in range(3):
                    a + b
                    a * b
                assert served() == s0
            finally:
                trace.remove_listener(got.append)
        return got

    on, off = records(True), records(False)
    assert len(on) == 6 and on == off
    assert _C._warm_info()["allowed"]


def test_spyre_profiler_sees_every_launch():
    from torch_spyre.profiler import profile

    a, b = _pair((64, 64), torch.float16)
    a + b
    with profile() as prof:
        for _ in range(3):
            a + b
    assert len(prof.kernels) == 3


def test_torch_profiler_sees_the_same_ops():
    a, b = _pair((64, 64), torch.float16)
    a + b

    def names(on):
        with warm(on), torch.profiler.profile() as prof:
            s0 = served()
            a + b
            assert served() == s0
        return [e.name for e in prof.events()]

    assert names(True) == names(False)


def test_timing_only_takes_the_python_path():
    a, b = _pair((64, 64), torch.float16)
    a + b
    s0 = served()
    with timing_only():
        assert not _C._warm_info()["allowed"]
        a + b
    assert served() == s0
    assert _C._warm_info()["allowed"]


# ------------------------------------------------------------ fallbacks
def _cases():
    a, b = _pair((64, 64), torch.float16)
    row = _pair((64,), torch.float16)[0]
    f32 = _pair((64, 64), torch.float32)[0]
    custom = _C._empty_in_layout([64, 64], [64, 64], [1, 64, 64], [0, 1, 0], a, 0)
    custom.copy_(b.cpu())
    out = torch.empty(64, 64, dtype=torch.float16, device="spyre")
    zero_dim = torch.tensor(2.0, dtype=torch.float16).to("spyre")
    return {
        "slice": lambda: a[:, :32] + b[:, :32],
        "transposed": lambda: a.t() + b,
        "offset": lambda: a[1:] + b[1:],
        "broadcast": lambda: a + row,
        "mixed_dtype": lambda: a + f32,
        "python_scalar": lambda: a + 1,
        "float_scalar": lambda: a * 0.5,
        "host_scalar_tensor": lambda: a + torch.tensor(3.0),
        "zero_dim": lambda: zero_dim + zero_dim,
        "alpha": lambda: torch.add(a, b, alpha=2),
        "sub_alpha": lambda: torch.sub(a, b, alpha=0.5),
        "out": lambda: torch.add(a, b, out=out),
        "inplace": lambda: out.copy_(b).add_(a),
        "custom_layout": lambda: a + custom,
        "reshaped": lambda: a.view(32, 128) + b.view(32, 128),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_calls_it_does_not_serve_go_through_python(case):
    fn = _cases()[case]

    def seq():
        r = fn()
        return [r] if r.numel() else []

    with warm(True):
        fn()
        s0 = served()
        fn()
        assert served() == s0
    _same(seq, expect_served=0)


def test_reshaped_whole_tensor_is_still_right():
    a, b = _pair((64, 64), torch.float16)
    got = a.view(32, 128) + b.view(32, 128)
    assert torch.equal(got.cpu(), (a.cpu() + b.cpu()).view(32, 128))


@pytest.mark.parametrize(
    "make",
    [
        lambda: (_pair((4, 4), torch.float16)[0], _pair((3, 3), torch.float16)[0]),
        lambda: (
            torch.zeros(4, 4, dtype=torch.float8_e4m3fn, device="spyre"),
            torch.zeros(4, 4, dtype=torch.float8_e4m3fn, device="spyre"),
        ),
        lambda: (_pair((4, 4), torch.float16)[0], torch.ones(4, 4, dtype=torch.float16)),
    ],
    ids=["shape_mismatch", "fp8", "device_mismatch"],
)
def test_errors_unchanged(make):
    a, b = make()

    def message(on):
        with warm(on):
            for _ in range(2):  # cold and warm
                with pytest.raises(Exception) as err:
                    a + b
        return type(err.value), str(err.value)

    assert message(True) == message(False)


# ------------------------------------------------------------- readers
@pytest.fixture
def big_views():
    VIEWS.set_budget(1 << 30)
    yield
    VIEWS.set_budget(1.0)


def test_output_read_through_every_reader(big_views):
    # a kept host view of a freed block must never serve the C++ output that
    # reuses its address (block ids are never reused), and every reader sees
    # what the C++ wrote
    w = torch.randn(256, 512).half()
    x = torch.randn(4, 512).half()
    a, b = _pair((256, 512), torch.float16, seed=5)
    ref = a.cpu() + b.cpu()
    dx = x.to("spyre")
    a + b  # cold: Python
    for _ in range(3):
        dw = w.to("spyre")
        for _ in range(3):
            dx @ dw.T  # kept as a host view
        del dw
        s0 = served()
        out = a + b
        assert served() == s0 + 1
        assert torch.equal(out.cpu(), ref)  # d2h copy
        assert torch.equal(out[3:9, 100:200].cpu(), ref[3:9, 100:200])  # a strided view
        assert out[7, 300].item() == ref[7, 300].item()  # _local_scalar_dense
        got = (dx @ out.T).cpu()  # a kernel reading it (host views)
        for _ in range(3):
            got = (dx @ out.T).cpu()  # now from a kept view of it
        want = (x.float() @ ref.float().T).half()
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        assert torch.equal((out * 1).cpu(), ref)  # the Python elementwise path
        assert torch.equal((out + out).cpu(), ref + ref)  # the C++ path reading it
        assert str(out.cpu()) == str(ref)


def test_in_place_write_after_cpp_output_invalidates_views(big_views):
    a, b = _pair((256, 512), torch.float16, seed=6)
    x = torch.randn(4, 512).half()
    dx = x.to("spyre")
    a + b
    out = a + b  # C++
    for _ in range(4):
        dx @ out.T  # kept
    out.add_(1)  # Python in-place writer
    want = (x.float() @ (a.cpu() + b.cpu() + 1).float().T).half()
    torch.testing.assert_close((dx @ out.T).cpu(), want, rtol=2e-3, atol=2e-3)


def test_second_card(spyre_python):
    code = """
        import torch, torch_spyre
        from torch_spyre import _C
        from torch_spyre.runtime import cards
        a = torch.randn(64, 64).half().to("spyre:1")
        b = torch.randn(64, 64).half().to("spyre:1")
        a + b
        res = []
        for on in (False, True):
            cards.warm_path(on)
            cards.card(1).reset()
            s0 = _C._warm_info()["served"]
            outs = [a + b for _ in range(3)]
            st = cards.card(1).stats()
            res.append((st["clock_s"], st["kernels"], st["kernel_time_s"], outs[0].device.index,
                        _C._device_bytes(outs[-1]).tolist(), _C._warm_info()["served"] - s0))
        assert res[0][:5] == res[1][:5], res
        assert (res[0][5], res[1][5]) == (0, 3)
        assert cards.card(0).stats()["kernels"] == 0
        print("ok")
    """
    proc = spyre_python(code, TORCH_SPYRE_NUM_CARDS="2")
    assert proc.stdout.split()[-1:] == ["ok"], proc.stderr


def test_autograd_through_the_warm_path():
    a0, b0 = _pair((64, 64), torch.float32, seed=3)

    def seq():
        a = a0.detach().requires_grad_()
        b = b0.detach().requires_grad_()
        y = (a * b + a) / b - b
        y.sum().backward()
        return [y.detach(), a.grad, b.grad]

    _same(seq)


def test_rebuilt_cards_get_their_launches():
    from torch_spyre.sim import reset_cards

    a, b = _pair((64, 64), torch.float16)
    a + b
    a + b
    reset_cards()  # forgets the C++ entries: their times were the old cards'
    try:
        s0 = served()
        a + b  # Python again, on the new card
        assert served() == s0
        a + b
        assert served() == s0 + 1
        assert cards.card(0).stats()["kernels"] == 2
    finally:
        reset_cards()


def test_a_full_kernel_cache_is_cleared_before_a_build(monkeypatch):
    """Clearing the cache forgets the vector ops the eager layer registered.
    It ran after a build, so the kernel just built named an op that no
    longer existed ("unknown vector op" at launch: the fuzzer's long run,
    after 8192 kernels).  Now it runs before the build."""
    monkeypatch.setattr(launch, "MAX_KERNELS", 3)
    launch.clear_cache()
    x = torch.randn(4, 40)
    d = x.to("spyre")
    for k in range(8):  # each scalar is its own kernel and vector op
        torch.testing.assert_close((d * (k + 0.5) + k).cpu(), x * (k + 0.5) + k)
    launch.clear_cache()
