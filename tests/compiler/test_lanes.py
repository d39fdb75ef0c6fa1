"""Compiled graphs that cut the stick dim below a stick, and the other ops whole
transformers models needed: lane gathers and scatters on the PE array, cos/sin,
isinf, constant negative indices, gathers routed to the device DMA kernel."""

from __future__ import annotations

import pytest
import torch

import torch_spyre
from torch_spyre.compiler import lanes
from torch_spyre.ir import constants
from torch_spyre.runtime import dispatch_stats
from torch_spyre.testing import tolerances


def _compiled(fn, *args, dtype=torch.float16):
    """fn on the card, compiled (fullgraph), against the fp32 CPU; no host fallback."""
    want = fn(*(a.float() if a.is_floating_point() else a for a in args))
    dev = [a.to(dtype).to("spyre") if a.is_floating_point() else a.to("spyre") for a in args]
    torch_spyre.reset_fallback_counts()
    got = torch.compile(fn, fullgraph=True, dynamic=False)(*dev)
    assert torch_spyre.fallback_counts() == {}
    return got.cpu(), want


def _compiled_kernels(fn, *args, dtype):
    """``_compiled``, and the names of the kernel programs the card ran."""
    from torch_spyre.sim import KernelRecord, trace

    records: list = []
    trace.add_listener(records.append)
    try:
        got, want = _compiled(fn, *args, dtype=dtype)
    finally:
        trace.remove_listener(records.append)
    return got, want, [r.name for r in records if isinstance(r, KernelRecord)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_heads_narrower_than_a_stick(dtype):
    """q.view(b, s, heads, 16).transpose(1, 2): pieces of 16 lanes of a 64-lane row."""

    def f(x):
        return x.view(1, 8, 4, 16).transpose(1, 2).contiguous() * 2

    got, want = _compiled(f, torch.randn(8, 64), dtype=dtype)
    torch.testing.assert_close(got.float(), want, **tolerances(dtype))


def test_strided_lanes_of_a_fused_qkv():
    """GPT-NeoX: qkv [s, heads * 3 * d] viewed [s, heads, 3d], queries = [..., :d]:
    lanes 48 h + i (i < 16) of each row."""

    def f(x):
        q, k, v = x.view(8, 4, 48).split(16, dim=-1)
        return (q + v).transpose(0, 1).contiguous()

    got, want = _compiled(f, torch.randn(8, 192))
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_slices_not_on_a_stick_boundary_and_step_two():
    """A slice from element 56 (Mamba's split) and DeepSeek's even/odd lanes."""

    def f(x):
        a = x[..., 56:72]
        return a[..., 0::2] * a[..., 1::2]

    got, want = _compiled(f, torch.randn(6, 128))
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_cats_and_slice_scatters_along_the_stick_dim():
    def f(x, y):
        key = torch.empty(4, 6, 32, device=x.device, dtype=x.dtype)
        key[..., :16] = x * 3
        key[..., 16:] = y.exp()
        return torch.cat([key, x + 1], dim=-1)

    got, want = _compiled(f, torch.randn(4, 6, 16), torch.randn(4, 6, 16))
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_rope_written_with_chunk():
    def f(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    args = (torch.randn(2, 4, 8, 64), torch.randn(8, 64), torch.randn(8, 64))
    got, want = _compiled(f, *args)
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_cos_and_sin_in_a_graph_are_the_polynomial():
    """A rotary table computed in the graph (no table adapter): range reduction +
    Horner polynomial as vector steps, angles of hundreds of radians."""

    def f(pos, inv_freq):
        ang = pos[:, None] * inv_freq[None, :]
        return torch.cat([ang.cos(), ang.sin()], dim=-1)

    pos = torch.arange(128, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    got, want = _compiled(f, pos, inv, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # fp32 range reduction of ~127 rad


def test_isinf_any_as_t5_clamps_fp16():
    def f(x):
        big = torch.finfo(x.dtype).max
        bound = torch.where(torch.isinf(x).any(), big - 1000, big)
        return torch.clamp(x * 2, min=-bound, max=bound)

    x = torch.randn(4, 96)
    got, want = _compiled(f, x)
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_constant_negative_index():
    """Falcon: key = qkv[:, :, [-2]] (an index tensor holding a constant)."""

    def f(x):
        return x[:, :, torch.tensor([-2], device=x.device)] * 2

    got, want = _compiled(f, torch.randn(1, 8, 6, 64))
    torch.testing.assert_close(got.float(), want, **tolerances(torch.float16))


def test_gather_runs_the_device_kernel():
    """BERT: token-type ids gathered through the position ids."""

    def f(buf, pos):
        return torch.gather(buf.expand(pos.shape[0], -1), 1, pos) * 2

    buf = torch.zeros(1, 64, dtype=torch.long)
    buf[0, 5:] = 1
    pos = torch.arange(10).unsqueeze(0)
    dispatch_stats.reset()
    got = torch.compile(f, fullgraph=True, dynamic=False)(buf.to("spyre"), pos.to("spyre"))
    assert torch.equal(got.cpu(), f(buf, pos))
    assert dispatch_stats.counts("fallback") == {}


def test_gather_tables():
    t = constants.table(8, 1, [(2, 3), (2, 1)], torch.float32)  # lanes 1 + 3 i + k
    hits = {(j, i, k) for j, i, k in t.nonzero().tolist()}
    assert hits == {(1, 0, 0), (2, 0, 1), (4, 1, 0), (5, 1, 1)}
    assert lanes.needs_gather(64, [4, 16], 0, 32) and not lanes.needs_gather(64, [2, 32], 0, 32)
    assert lanes.needs_gather(128, [16], 56, 64) and not lanes.needs_gather(128, [64], 64, 64)


def test_sub_block_of_a_reshaped_dim():
    """The last 6 positions of each of 2 heads of a [2 * 10, 32] projection (a
    sliding-window cache keeping its window): pieces (2, 10) read from (0, 4)."""

    def f(x):
        return x.view(2, 10, 32)[:, 4:] * 2

    got, want = _compiled(f, torch.randn(20, 32), dtype=torch.float32)
    torch.testing.assert_close(got, want, **tolerances(torch.float32))


def test_rolled_cache_and_modular_indices():
    """A full sliding-window cache shifts by one each decode step: roll is a
    modular index, read by the device gather; the index itself is computed
    in a kernel (fmod on the vector unit)."""

    def f(cache, new):
        rolled = cache.roll(-1, dims=-2)
        rolled[:, :, torch.tensor([-1], device=cache.device)] = new
        idx = (torch.arange(8, device=cache.device) + 3) % 8
        return rolled[:, :, idx] + 1

    got, want = _compiled(
        f, torch.randn(1, 2, 8, 16), torch.randn(1, 2, 1, 16), dtype=torch.float32
    )
    torch.testing.assert_close(got, want, **tolerances(torch.float32))


def _rotate_every_two(x):
    """GLM / Cohere / GPT-J's interleaved rotary: lane 2 i + j of the output."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interleaved_rotary_stores_lanes_on_the_pe_array(dtype):
    """A store cutting the stick dim into pairs (lane_steps._scatter): planned,
    not degraded to eager kernels; fp32 exact (one product x * 1 per lane)."""
    from torch_spyre.compiler import degrade

    def f(q, cos, sin):
        return q * cos + _rotate_every_two(q) * sin

    args = (torch.randn(1, 4, 5, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16))
    degrade.reset_counts()
    got, want = _compiled(f, *args, dtype=dtype)
    assert degrade.counts()["eager"] == 0
    torch.testing.assert_close(got.float(), want, **tolerances(dtype))


def test_interleaved_store_of_infinities_is_a_select():
    """A value that may be infinite (a -inf fill) is placed on lanes by a select
    on the vector unit: through the PE array's table, -inf * 0 would be NaN."""
    from torch_spyre.compiler import degrade

    def f(x, m):
        return _rotate_every_two(x.masked_fill(m, float("-inf"))) * 2 + 1

    x = torch.randn(3, 32)
    degrade.reset_counts()
    got, want = _compiled(f, x, x > 1, dtype=torch.float32)
    assert degrade.counts()["eager"] == 0
    assert torch.isinf(want).any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["bool", "neg_inf", "wide"])
def test_last_dim_pads_of_masks_are_the_device_cat(case):
    """GIT's padded masks: a pad of the stick dim of a bool or -inf mask (a
    lane table would multiply -inf by 0), or wider than a lane table, is
    ``spyre::cat`` of fill pieces and x: planned, exact, no eager node."""
    import torch.nn.functional as F

    from torch_spyre.compiler import degrade

    if case == "bool":
        fn, x = (lambda m: F.pad(m, (0, 5), value=True) & m.any()), torch.randn(2, 7) > 0
    elif case == "neg_inf":

        def fn(x):
            mask = torch.where(x > 0, 0.0, float("-inf"))
            return F.pad(mask, (3, 2), value=float("-inf")) + 1

        x = torch.randn(2, 7)
    else:
        fn, x = (lambda x: F.pad(x * 2, (1, 600), value=0.5)), torch.randn(2, 3000)
    degrade.reset_counts()
    torch_spyre.reset_fallback_counts()
    got = torch.compile(fn, fullgraph=True)(x.to("spyre")).cpu()
    assert degrade.counts()["eager"] == 0 and torch_spyre.fallback_counts() == {}
    assert torch.equal(got, fn(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotate_half_of_a_transposed_projection_reads_it_in_place(dtype):
    """RoPE on ``proj(x).view(b, s, h, d).transpose(1, 2)``: the rotation's
    permutation matmul reads the projection's rows where they lie (no copy of
    the transposed view into heads-major order first), and the result is
    exact in fp32."""

    def f(x, w, cos, sin):
        q = (x @ w.t()).view(2, 8, 4, 128).transpose(1, 2)
        rot = torch.cat((-q[..., 64:], q[..., :64]), dim=-1)
        return q * cos + rot * sin

    args = (
        torch.randn(2, 8, 256),
        torch.randn(512, 256) / 16,
        torch.randn(8, 128),
        torch.randn(8, 128),
    )
    got, want, names = _compiled_kernels(f, *args, dtype=dtype)
    assert not any("clone" in n for n in names), names
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_ropes_epilogue_reads_the_rotations_operand_tile_in_lx(dtype):
    """RoPE's program loads q once: the rotation matmul reads q's head dim
    as its k (``t0 <- q[.., d2]``) and the epilogue ``q * cos`` reads it as
    its output dim; with both whole on every core the epilogue renames the
    tile in LX (``plan._reuse_operand_tiles``) instead of loading q again
    (Granite-8B's prefill: Q's RoPE program 224.0 -> 156.3 us)."""
    from torch_spyre.compiler import scheduling
    from torch_spyre.ir import Load, Matmul, Vector

    def f(x, w, cos, sin):
        q = (x @ w.t()).view(1, 16, 4, 128).transpose(1, 2)
        rot = torch.cat((-q[..., 64:], q[..., :64]), dim=-1)
        return q * cos + rot * sin

    args = (torch.randn(1, 16, 256), torch.randn(512, 256) / 16, torch.randn(16, 128),
            torch.randn(16, 128))  # fmt: skip
    scheduling.PLANS.clear()  # bounded: a trim during this compile would hide its plans
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # plan, don't replay
        got, want, names = _compiled_kernels(f, *args, dtype=dtype)
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(got.float(), want, **tol)
    (rope,) = [n for n in names if n.startswith("fused_mm_")]
    (prog,) = [p.program for p in scheduling.PLANS if p.program.name == rope]
    mm = next(s for s in prog.steps if isinstance(s, Matmul))
    (q_load,) = [s for s in prog.steps if isinstance(s, Load) and s.buffer == mm.a]
    assert [s for s in prog.steps if isinstance(s, Load) and s.operand == q_load.operand] == [
        q_load
    ]
    assert any(
        isinstance(s, Vector) and s.op == "rename" and s.inputs == (mm.a,) for s in prog.steps
    )


def test_a_rename_must_swap_one_dim_for_one_of_its_size():
    """The validator refuses a ``rename`` between dims of other sizes, or one
    that would need a tile split over cores."""
    from torch_spyre.ir import Buffer, Dim, Load, Operand, Program, ProgramError, Store, Vector
    from torch_spyre.layout import SpyreTensorLayout

    def prog(b_size: int, cores: int) -> Program:
        lay = SpyreTensorLayout.default((4, 64), torch.float16)
        return Program(
            name="rename",
            dims=(Dim("a", 4), Dim("k", 64), Dim("n", b_size, cores)),
            operands=(Operand("x", lay, "input"),
                      Operand("y", SpyreTensorLayout.default((4, b_size), torch.float16), "output")),
            buffers=(Buffer("t0", ("a", "k"), torch.float16), Buffer("t1", ("a", "n"), torch.float16)),
            steps=(Load("t0", "x", ("a", "k")), Vector("rename", "t1", ("t0",)),
                   Store("y", "t1", ("a", "n"))),
            loop_order=("a", "n"),
        )  # fmt: skip

    prog(64, 1).validate()
    with pytest.raises(ProgramError, match="rename"):
        prog(128, 1).validate()
    with pytest.raises(ProgramError, match="rename"):
        prog(64, 2).validate()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotate_half_of_a_projection_written_in_place_is_still_one_matmul(dtype):
    """A projection whose output is then written in place through a view (a
    LoRA delta: ``spyre::punica_sgmv`` adds into ``out.view(-1, n)``): after
    functionalization each slice of rotate_half reads the updated output
    through its own reshape/permute chain.  The chains are one value
    (``passes._same_view``), so the rotation is still the lane-shuffle matmul
    with RoPE as its epilogue, not a negated copy of slices (three programs
    where there were six: the LoRA decode step of an estimate lost ~26 us a
    layer there)."""

    def f(x, w, cos, sin):
        out = x @ w.t()
        out.view(-1, out.shape[-1]).add_(1.0)  # in place, through a view
        q = out.view(1, 16, 4, 128).transpose(1, 2)
        rot = torch.cat((-q[..., 64:], q[..., :64]), dim=-1)
        return q * cos + rot * sin

    args = (torch.randn(16, 256), torch.randn(512, 256) / 16, torch.randn(16, 128),
            torch.randn(16, 128))  # fmt: skip
    got, want, names = _compiled_kernels(f, *args, dtype=dtype)
    assert not any("neg" in n for n in names) and len(names) == 3, names
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("batch,seq", [(4, 16), (3, 5)])
def test_rope_of_a_batched_projection_fuses_its_rotation(dtype, batch, seq):
    """With a batch, the projection's rows are batch*tokens x heads, and RoPE
    reads the rotation's output as batch x heads x tokens: the rotation matmul
    is planned in the reader's pieces (``lowering.ReadShape``), so it keeps
    RoPE as its epilogue (one program per projection, not the matmul and then
    RoPE: Granite-8B's 32 x 512 prefill lost ~114 ms to the split)."""

    def rot(t):
        return torch.cat((-t[..., 64:], t[..., :64]), dim=-1)

    def f(x, wq, wk, cos, sin):
        b, s, _ = x.shape
        q = (x @ wq.t()).view(b, s, 4, 128).transpose(1, 2)
        k = (x @ wk.t()).view(b, s, 2, 128).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat([q * cos + rot(q) * sin, k * cos + rot(k) * sin], dim=1)

    args = (torch.randn(batch, seq, 256), torch.randn(512, 256) / 16,
            torch.randn(256, 256) / 16, torch.randn(batch, seq, 128),
            torch.randn(batch, seq, 128))  # fmt: skip
    got, want, names = _compiled_kernels(f, *args, dtype=dtype)
    # two projections, two rotations with their RoPE epilogue, the cat
    assert len(names) == 5 and sum(n.startswith("fused_mm_") for n in names) == 2, names
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(got.float(), want, **tol)


def test_the_memoised_infinity_walk_answers_as_the_walk():
    """``any_may_be_infinite`` (each node's answer kept for a lowered graph)
    says what ``may_be_infinite`` says for every node of a graph with a -inf
    fill, a log, attention over a -inf mask, and plain arithmetic."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_spyre.compiler.infinities import any_may_be_infinite, may_be_infinite

    def f(q, k, v, m, x):
        s = F.scaled_dot_product_attention(q, k, v, attn_mask=m.masked_fill(m < 0, float("-inf")))
        y = s * 2 + x.sum()
        return y, (x.abs() + 1).log(), y.exp(), x * 3

    args = [torch.randn(1, 2, 4, 8)] * 3 + [torch.randn(4, 4), torch.randn(4, 8)]
    gm = make_fx(f)(*args)
    nodes = list(gm.graph.nodes)
    want = {n: may_be_infinite(n) for n in nodes}
    assert any(want.values()) and not all(want.values())
    for n in reversed(nodes):  # the memo filled in another order than a walk's
        assert any_may_be_infinite([n]) == want[n], n
    assert any_may_be_infinite(nodes) is True
    assert any_may_be_infinite([n for n in nodes if not want[n]]) is False
