"""Compiler bugs the fuzzer found (torch_spyre.tools.fuzz), each minimised and
pinned here with its fix (docs/compiler.md, "The fuzzer").

Each case is compiled on spyre and compared with the CPU; the ones whose fix
plans the op assert that no degrade step is taken
(``compile_fallback="error"``)."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import fresh_cache

from torch_spyre.compiler import degrade
from torch_spyre.runtime import dispatch_stats


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _check(fn, *args, atol=1e-5):
    """``fn`` compiled on spyre against the CPU; an argument may be a function
    of the device (a view taken on the device: a non-contiguous input)."""
    want = fn(*[a("cpu") if callable(a) else a for a in args])
    got = _compile(fn)(*[a("spyre") if callable(a) else a.to("spyre") for a in args])
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=atol)


def test_eager_node_reads_an_input_freed_before_it(monkeypatch):
    """Seed 0: a node run as eager kernels (a pad of an outer dim, then a
    softmax) recomputes ``var`` from the graph input (a welford reduction's
    buffer holds M2, not the variance), which Inductor had already freed
    after its last declared reader: the wrapper raised UnboundLocalError.
    The input is now kept alive.  (Outer-dim pads are device kernels now;
    the case is reproduced with that route off.)"""
    from torch_spyre.compiler import passes

    monkeypatch.setattr(passes, "_route_outer_pads", lambda gm: False)

    def fn(x, w):
        v = x.var([0], keepdim=True, unbiased=False)
        return F.rms_norm(v, (8,), w, 1e-6), F.softmax(F.pad(v, [1, 2, 0, 0], value=0.5), dim=0)

    x, w = torch.rand(32, 1, 8) * 4 - 2, torch.rand(1) + 0.5
    with fresh_cache():
        _check(fn, x, lambda d: w[:1].to(d).expand(8))


def test_welford_buffers_run_as_eager_kernels(refuse):
    """A welford reduction (var_mean of a layer norm) that does not plan: its
    buffers (mean, M2, count) have no FX node; they are computed by eager
    ops from the reduction's input."""
    refuse("var_mean")
    degrade.reset_counts()

    def fn(x, w, b):
        return F.layer_norm(x.exp(), (70,), w, b, 1e-5)

    _check(fn, torch.randn(6, 70), torch.rand(70) + 0.5, torch.randn(70))
    assert degrade.counts()["eager"] >= 1


def test_a_copy_realized_for_a_matmul_runs_eagerly():
    """Seed 357: a strided view reshaped for a matmul is copied in a buffer
    Inductor realizes while lowering the matmul (no FX node recorded); it
    degrades, and is found as the last of its origins (``reshape``)."""

    def fn(x, w, b):
        return F.linear(x.reshape(256), w, b)

    x, w = torch.rand(128, 4) * 4 - 2, torch.rand(256, 16) * 0.125 - 0.0625
    _check(fn, lambda d: x.to(d)[:, ::2], lambda d: w.to(d).t(), torch.rand(16) - 0.5)


def test_scatters_are_device_kernels(spyre_settings):
    """Seed 16: ``scatter`` / ``scatter_add`` / ``scatter_reduce`` were lowered
    to a copy and an indirect store (a mutation, with no FX node to run
    eagerly): the compile aborted.  They are ``spyre::scatter``, the eager
    device scatter, planned (no degrade step)."""
    spyre_settings(compile_fallback="error")
    x, src = torch.randn(12, 32, 8), torch.randn(4, 32, 8)
    idx = torch.rand(12, 32, 8).argsort(dim=0)[:4]

    def fn(x, i, s):
        return (
            x.scatter(0, i, s)[:, :, 0],
            x.scatter_add(0, i, s),
            x.scatter(1, i[:, :2], 0.5),
            x.scatter_reduce(0, i, s, "amax"),
        )

    _check(fn, x, idx, src)


def test_pad_of_an_outer_dim_before_a_reduction(spyre_settings):
    """Seed 92: a pad of an outer dim read by ``var`` was realized inside the
    reduction's lowering (masked loads, no FX node): the compile aborted.
    A pad of an outer dim is ``spyre::pad``, the device's pad."""
    spyre_settings(compile_fallback="error")

    def fn(x):
        return F.pad(x, [1, 3, 0, 3], value=0.5).var([0], keepdim=False, unbiased=False)

    _check(fn, torch.rand(7, 1, 1) * 4 - 2)


def test_replicate_pad_before_a_layer_norm(spyre_settings):
    """Seed 333: replicate / reflect pads decompose to ``_unsafe_index`` by
    clamped iotas, a gather inside a kernel program: the compile aborted.
    They take the device index kernel, as ``aten.index`` does."""
    spyre_settings(compile_fallback="error")

    def fn(x, w, b):
        return (
            F.layer_norm(F.pad(x.abs(), [2, 3], mode="replicate"), (69,), w, b, 1e-5),
            F.pad(x.unsqueeze(0), [3, 1], mode="reflect"),
        )

    _check(fn, torch.randn(16, 64), torch.rand(69) + 0.5, torch.rand(69) - 0.5)


def test_reduction_over_most_of_a_transposed_input(spyre_settings):
    """Seed 283: Inductor split a reduction with few outputs into two kernels,
    the first reading the rows through a view no program expresses: the
    compile aborted.  Reductions are never split for spyre (the planner
    streams long rows itself)."""
    spyre_settings(compile_fallback="error")

    def fn(x):
        return x.mT.mean([0, 1, 3], keepdim=False), x.sum()

    _check(fn, torch.rand(3, 8, 6, 2) * 4 - 2)
    _check(lambda x: x.mT.amax([0, 1, 3]), torch.randn(4, 40, 30, 20))


def test_a_read_after_an_in_place_op_sees_what_it_wrote():
    """Seed 100126: ``index_add`` lowers to a copy and an in-place
    ``index_put_``; ``std`` then runs as eager kernels (welford), and its
    recomputed code started from the graph input the copy came from: it read
    the tensor as it was before the write.  A silent wrong answer.  An eager
    node now holds the written buffer, and refuses to re-run a producer of a
    tensor an in-place op wrote before it."""

    def fn(x, idx, src):
        return x.index_add(0, idx, src).std([1], keepdim=False)

    g = torch.Generator().manual_seed(100126)
    x = torch.rand(2, 129, generator=g) * 4 - 2
    src = torch.rand(1, 129, generator=g) * 4 - 2
    _check(fn, x, torch.tensor([1]), src)


def test_a_small_constant_of_a_pass_in_an_eager_node():
    """Seed 100111: a pad's fill (a graph constant our passes add) that Inductor
    inlined was not held by the wrapper, so an eager node reading it could
    not be built: the compile aborted.  Small constants are written into the
    eager node's code."""

    def fn(x, w):
        return F.layer_norm(F.pad(x, [3, 1], value=0.5), (5,), w, None, 1e-5)

    g = torch.Generator().manual_seed(100111)
    base = torch.rand(1, 2, generator=g) * 4 - 2
    _check(fn, lambda d: base.to(d).transpose(0, 1), torch.rand(5) + 0.5)


def test_a_row_slice_of_a_narrow_tensor_in_a_same_layout_program(spyre_settings):
    """Seed 100255: ``x[35:] * y`` with a stick dim of 2: the slice's operand
    was bound as a flat run of device memory, the others in their device
    shape, and the program failed on the card (a crash, the card then in
    its stream error).  Every bound slice has its operand's device shape."""
    spyre_settings(compile_fallback="error")

    def fn(x, y):
        return x[35:] * y

    _check(fn, torch.rand(37, 2) * 4 - 2, torch.rand(2, 2) * 4 - 2)


def test_index_add_into_an_expanded_input():
    """Seeds 200310, 200431: ``index_add`` of an expanded input (stride 0):
    the functional op's value is a dense copy, but the in-place index_put_
    wrote through the overlapping view (an error on the card)."""

    def fn(x, idx, src):
        return F.pad(x.index_add(1, idx, src), [0, 1], value=0.5)

    base = torch.rand(1, 1, 2, 1) * 4 - 2
    _check(fn, lambda d: base.to(d).expand(1, 2, 2, 1), torch.tensor([1]), torch.rand(1, 1, 2, 1))


def test_index_add_into_a_chunk_of_a_computed_tensor():
    """Seed 201001: ``index_add`` into a chunk of a computed tensor: Inductor
    realized the chunk, wrote it in place and copied it back into the
    tensor; the copy was planned with the chunk's shape but bound to the
    whole tensor (an error on the card; before the read-after-write fix, a
    wrong answer).  A store into part of another buffer degrades."""

    def fn(a, b, idx, src):
        return (a - b).chunk(4, 2)[0].index_add(2, idx, src)

    a = torch.rand(5, 2, 1) * 4 - 2
    _check(
        fn, lambda d: a.to(d).transpose(0, 2), torch.rand(1, 1, 5), torch.tensor([1]),
        torch.rand(1, 2, 1),
    )  # fmt: skip


def test_index_add_into_a_slice_of_a_computed_tensor():
    """Seed 201245: the copy back into a slice ran as eager kernels that
    computed the slice's value and stored it over the whole buffer (a shape
    error at run time).  It runs on the host from the IR's store index."""

    def fn(x, idx, src):
        return torch.cos(x)[1:33].index_add(2, idx, src)

    _check(fn, torch.rand(33, 1, 1, 1), torch.tensor([0]), torch.rand(32, 1, 1, 1))


def test_a_mask_gathered_across_lanes_stays_a_mask(spyre_settings):
    """Seed 200627: a bool mask read at shifted lanes went through the lane
    gather (a matmul) and came out fp32; the ``where`` reading it failed on
    the card.  A gathered mask is converted back to bool."""
    spyre_settings(compile_fallback="error")

    def fn(a, b, c, mask, other):
        return torch.where(mask, torch.cat([a, b, c]), other)[63:97]

    g = torch.Generator().manual_seed(200627)
    args = [torch.rand(n, generator=g) for n in (63, 3, 31)]
    _check(fn, *args, torch.rand(97, generator=g) < 0.8, torch.rand(1))


@pytest.mark.parametrize(
    "case",
    ["conv2d_dilated_grouped_permuted_weight", "conv1d_of_a_transposed_input"],
)
def test_host_convolutions_have_the_layout_fake_tensors_give(case):
    """Seeds 200558, 200784: a convolution the card does not run took the
    host kernel, which picked channels-last for a permuted input; the
    compiled graph asserts the strides FakeTensor computed (contiguous)."""
    if case.startswith("conv2d"):
        w = torch.rand(2, 3, 3, 1) - 0.5

        def fn(x, w, b):
            return F.conv2d(x, w, b, stride=2, dilation=2, groups=2)

        _check(fn, torch.rand(1, 2, 5, 7), lambda d: w.to(d).transpose(1, 3), torch.rand(2))
    else:

        def fn(x, w):
            return F.conv1d(x.mT, w, None, stride=2, padding=1)

        _check(fn, torch.rand(1, 3, 1), torch.rand(2, 1, 3) - 0.5)


def test_a_tensor_broadcast_against_itself(spyre_settings):
    """Seed 202316: ``maximum(x, x[None, :, None])`` reads x at two indices of
    one node; the planner reused the first load for the second and unified
    the two index variables (max(x_i, x_i) for max(x_j, x_i)): a wrong
    answer.  Two distinct variables of one node are never unified."""
    spyre_settings(compile_fallback="error")

    def fn(x):
        return torch.linalg.vector_norm(torch.maximum(x, x[None, :, None]), 2, [2])

    _check(fn, torch.rand(8) * 4 - 2)


def test_a_pooling_reader_of_a_buffer_in_another_layout():
    """Seed 201838: softmax then avg_pool2d: the softmax's output was stored
    in another stick dim (its readers costed cheaper so), but the pooling
    read it in pieces of the default layout: a wrong answer.  A read in
    pieces refuses a buffer stored in another layout, so that layout is
    not chosen."""

    def fn(x):
        return F.avg_pool2d(F.softmax(x, -1), 4, 1, 0)

    _check(fn, torch.rand(3, 8, 11, 5) * 2)


def test_a_where_broadcast_against_its_own_transpose(spyre_settings):
    """Seed 300948: ``v2 = where(x > .25, x, y)`` then ``v2.T + v2``: the same
    operand loaded at two variables of one node; after the second load the
    group remembered only the newest index, so a third load at that index
    took the first tile (x[i] for x[j]): a wrong answer.  Every load of an
    operand is remembered with its index."""
    spyre_settings(compile_fallback="error")

    def fn(x, y):
        v = torch.where(x > 0.25, x, y)
        return v.transpose(1, 0) + v

    _check(fn, torch.rand(1, 2) * 4 - 2, torch.rand(2) * 4 - 2)


def test_a_matmul_reading_a_restickified_input():
    """Seed 300566: an extern matmul planned to read its input in another
    stick dim named the re-laid copy, but the wrapper's matmul path never
    emitted the copy (NameError at run time).  The copy is emitted first."""

    def fn(x, w, b, idx, src):
        e = F.elu(x)
        return F.linear(e.reshape(129, 2, 25, 1), w, b), F.softmax(e, dim=0).scatter(0, idx, src)

    g = torch.Generator().manual_seed(300566)
    x = (torch.rand(129, 100, 1, generator=g) * 4 - 2)[:, ::2]
    idx = torch.rand(129, 50, 1, generator=g).argsort(dim=0)[:1]
    _check(fn, x, torch.rand(1, 1) - 0.5, torch.rand(1) - 0.5, idx, torch.rand(1, 50, 1))


def test_an_assert_in_a_compiled_graph_runs_and_raises():
    """From the architecture sweep (LongCat-Flash's router): ``one_hot``
    asserts its classes are non-negative; the assert node has no buffer
    (Inductor removes it) and ran as eager kernels storing into it: a
    NameError.  It runs for its effect, and still raises on bad input."""

    def fn(i, w):
        return F.one_hot(i, 8).float() @ w

    w = torch.randn(8, 4)
    _check(fn, torch.tensor([1, 3, 7]), w)
    with pytest.raises(RuntimeError, match="non-negative"):
        _compile(fn)(torch.tensor([1, -3, 7]).to("spyre"), w.to("spyre"))


def test_an_eager_view_of_a_buffer_in_another_layout():
    """Seed 302140: avg_pool1d, stacked and convolved: an eager node re-ran a
    ``view`` the FX graph took of a tensor with its meta strides, on the
    buffer Inductor laid out otherwise (a RuntimeError at run time).  Views
    re-run as reshapes: the same values, whatever the buffer's strides."""

    def fn(x, y, w, b):
        p = F.avg_pool1d(x, 4, 1, 1)
        return torch.stack([p, y, y], dim=3), F.conv1d(p, w, b, padding=1)

    _check(
        fn, torch.rand(5, 65, 4) * 5 - 3, torch.rand(5, 65, 3), torch.rand(64, 65, 2) * 0.2 - 0.1,
        torch.rand(64) - 0.5,
    )  # fmt: skip


def test_an_index_of_a_transposed_input_has_the_strides_its_fake_promised():
    """Seed 303925: ``x[:, idx]`` of a transposed input: ``spyre::index``'s fake
    and its kernel gave different strides, and the compiled graph's stride
    assert failed.  Both return a contiguous tensor."""

    def fn(x, idx):
        return x[:, idx]

    base = torch.rand(2, 1, 1) * 4 - 2
    _check(fn, lambda d: base.to(d).transpose(0, 2), torch.tensor([[0, 0]]))


def test_index_add_into_a_row_slice_input():
    """Seed 304553: ``x[1:2].index_add(...)``: the planner read the slice's
    stick window from one stick before the tensor's first element (a
    negative start into its memory; sliced in Python, the wrong elements).
    Such a read is not planned, and a bound read outside the tensor raises."""

    def fn(x, idx, src):
        return x.index_add(0, idx, src)

    base = torch.rand(4, 2) * 4 - 2
    _check(fn, lambda d: base.to(d)[1:2], torch.tensor([0]), torch.rand(1, 2) * 4 - 2)


def test_a_host_node_of_a_padded_pool():
    """Seed 305822: the host code (the last degrade step) had no ``ops.and_``
    for the bounds mask of a padded ``avg_pool1d``: the compile aborted."""

    def fn(x, y):
        return torch.minimum(F.avg_pool1d(x, 2, 2, 1), y)

    _check(fn, torch.rand(1, 1, 1) * 4, torch.rand(1, 1) * 4 - 2)


def test_a_host_node_reading_an_expanded_input():
    """Seed 305334: a host node's input copy wrote an expanded (stride 0)
    tensor through an overlapping view (a RuntimeError): copied by position."""

    def fn(x):
        return x.flip([1]).transpose(1, 2).mean([1])

    base = torch.rand(1, 2, 1) * 4 - 2
    _check(fn, lambda d: base.to(d).expand(1, 2, 8))


def test_index_add_of_a_tensor_another_op_reads():
    """Seeds 400362, 400858: ``v = a * b; v.index_add(...)`` while another op
    reads ``v`` lazily (a pointwise Inductor inlines): written in place, the
    reader was realized only when the write marked ``v`` mutated, after it,
    and read the new values (a wrong answer).  The in-place form is taken
    only when nothing else reads the old value (a KV cache's write)."""

    def fn(a, b, idx, src, s, w, bias):
        v = a * b
        return v.index_add(0, idx, src), F.layer_norm(s * v, (8,), w, bias, 1e-5)

    g = torch.Generator().manual_seed(400362)
    _check(
        fn, torch.rand(8, 12, 1, 1, generator=g) * 4 - 2, torch.rand(1, 12, 8, generator=g) * 4 - 2,
        torch.randint(0, 8, (8,), generator=g), torch.rand(8, 12, 12, 8, generator=g) * 4 - 2,
        torch.rand(1, 1, 1, 1, generator=g) * 4 - 2, torch.rand(8, generator=g) + 0.5,
        torch.rand(8, generator=g) - 0.5,
    )  # fmt: skip


def test_an_elementwise_program_over_two_views_of_one_layout(spyre_settings):
    """Seed 500871: ``maximum(y, x.reshape(2, 1536))`` with x [2, 48, 32]: the
    program reads both as [2, 48, 32] (the same bytes), but the executor's
    same-layout path broadcast the [2, 1536] tensor's memory shape against
    the other's and failed on the card.  Operands take the output's shape."""
    spyre_settings(compile_fallback="error")

    def fn(x, y):
        return torch.maximum(y, x.reshape(2, 1536))

    _check(fn, torch.rand(2, 48, 32) * 4 - 2, torch.rand(2, 1536) * 4 - 2)


def test_the_product_of_an_expanded_input(spyre_settings):
    """Seed 600480: ``prod`` over a dim an expanded input repeats (stride 0):
    the planner dropped the reduction of a value constant along it (right for
    max and min, scaled for sum, and for prod the value itself instead of its
    power): a wrong answer."""
    spyre_settings(compile_fallback="error")

    def fn(x):
        return x.prod(-1, keepdim=True), x.sum(-1), x.amax(-1)

    base = torch.rand(1, 1) + 0.5
    _check(fn, lambda d: base.to(d).expand(1, 3))


def test_index_add_into_a_matmul_output_viewed_in_another_shape():
    """Seed 600354: ``linear(...).index_add(1, ...)``: the scatter's buffer is the
    matmul's [512, 8] output, which the FX graph views as [16, 32, 8]; the
    eager node read and stored it in the buffer's shape (a shape error), and a
    store of the whole buffer in another shape was taken for a partial one
    (an aborted compile).  Held buffers are read in the FX node's shape."""

    def fn(x, w, b, idx, src):
        y = F.linear(x, w, b)
        return y.index_add(1, idx, src), b * (y / 3.0)

    g = torch.Generator().manual_seed(600354)
    _check(
        fn, torch.rand(16, 32, 32, generator=g), torch.rand(8, 32, generator=g) * 0.3,
        torch.rand(8, generator=g) - 0.5, torch.randint(0, 32, (6,), generator=g),
        torch.rand(16, 6, 8, generator=g) * 4 - 2,
    )  # fmt: skip


def test_index_add_into_a_select_of_a_computed_tensor():
    """Seed 600951: ``where(...)[1].index_add(...)``.  Made in place, the write
    through the select became an ``as_strided`` of the base tensor's storage,
    but the select was realized into a buffer of its own (1280 of the
    storage's 2560 elements), which the IR then read past its end (the host
    path raised).  A write into a view of a computed tensor goes into a dense
    copy (``compiler/storage_views.py``)."""

    def fn(x, idx, src):
        v = F.leaky_relu(x, 0.1)
        return v - v, v[1].index_add(1, idx, src), v.flatten(1, 3)

    g = torch.Generator().manual_seed(600951)
    x = torch.rand(2, 5, 16, 16, generator=g) * 32 - 16
    _check(fn, x, torch.randint(0, 16, (8,), generator=g), torch.rand(5, 8, 16, generator=g))


def test_index_add_of_a_flipped_tensor_another_op_reads():
    """Seed 700692: ``flip(x).index_add(1, ...)`` with another reader of the
    flip: Inductor lowers the scatter as a copy of its input (tracked to the
    scatter's FX node) and a write into it; the copy ran as the whole
    index_add and the write added again (a wrong answer).  A copy a scatter
    writes into is never taken for the scatter's value."""

    def fn(x, idx, src, rows):
        v = x.flip([0])
        return v.index_add(1, idx, src), v[rows].movedim(1, 2)

    g = torch.Generator().manual_seed(700692)
    _check(
        fn, torch.rand(65, 5, 4, generator=g) * 4 - 2, torch.randint(0, 5, (4,), generator=g),
        torch.rand(65, 4, 4, generator=g) * 4 - 2, torch.randint(0, 65, (1,), generator=g),
    )  # fmt: skip


def test_two_index_adds_of_one_computed_tensor():
    """Seed 703362: two ``index_add`` of ``tril(x)``: a scatter the eager path
    may not re-run (it reads its input before the other scatter's write) had
    no host code (``ir.Scatter``): the compile aborted.  Host nodes now run
    scatters, accumulating for a scatter-add."""

    def fn(x, i1, s1, i2, s2):
        t = torch.tril(x, 0)
        return t.index_add(0, i1, s1), t.index_add(0, i2, s2)

    g = torch.Generator().manual_seed(703362)
    _check(
        fn, torch.rand(6, 5, generator=g) * 4 - 2, torch.tensor([1, 1, 4]),
        torch.rand(3, 5, generator=g), torch.tensor([0, 5]), torch.rand(2, 5, generator=g),
    )  # fmt: skip


def test_dispatch_counts_unchanged_by_the_tests():
    """The cases above run on device kernels (no host fallback)."""
    dispatch_stats.reset("fallback")
    _check(lambda x: F.pad(x, [1, 1, 1, 1]).sum(0), torch.randn(5, 6, 70))
    assert not dispatch_stats.counts("fallback")


def test_an_outer_fill_never_overtakes_a_reader_of_its_buffer():
    """Seed 800099: ``masked_fill(x > 0.25, -0.75).repeat(2, 2)``.  The repeat's
    lane placement makes it a matmul program whose prologue (the compare and
    the where) runs in the k loop; the two fills (0.25 and -0.75) shared one
    LX buffer, and moving the -0.75 fill ahead of the k-loop steps overwrote
    the threshold before the compare read it (a wrong answer).  A step moves
    ahead only past steps it has no dependence on."""

    def fn(v0, v1):
        return v1.masked_fill(v0 > 0.25, -0.75).repeat(2, 2)

    g = torch.Generator().manual_seed(800099)
    v0 = torch.rand(4, 3, generator=g) * 4 - 2
    v1 = torch.rand(1, 3, generator=g) * 7 + 0.14
    _check(fn, v0[1:2], v1)


def test_a_dim_read_at_one_position_is_not_the_whole_dims_tile():
    """Seed 800418: ``softmax(pad(x), dim=1)`` over a dim of 2.  Inductor
    unrolls the row's max and sum into reads of ``x[:, 0]`` and ``x[:, 1]``;
    the read of ``x[:, 0]`` was served by the group's tile of ``x[:, j]`` (all
    of dim 1), so every row summed itself and ``x[:, 1]`` (a wrong answer)."""

    def fn(x):
        return F.softmax(F.pad(x, [2, 3], value=0.0), dim=1)

    g = torch.Generator().manual_seed(800418)
    _check(fn, torch.rand(2, 2, 2, 1, generator=g) * 9.8 - 4.9)


def test_a_matmul_stored_in_sub_stick_pieces():
    """Seed 803940: ``x @ x.reshape(31, 62)`` with x [31, 2, 31]: the matmul's
    store cuts the stick dim into pieces (a lane placement), and the check
    whether its value may be infinite read the node's FX origins, which the
    matmul path never set (the builder's attribute fallback answered with a
    function: the compile failed)."""

    def fn(v0):
        return v0 @ v0.reshape(31, 62)

    g = torch.Generator().manual_seed(803940)
    _check(fn, torch.rand(31, 2, 31, generator=g) * 4 - 2, atol=1e-4)


def test_a_welford_buffer_is_computed_from_its_reduction():
    """Seed 805763: an RMS norm then a layer norm of a repeat-interleaved,
    transposed input.  Both run as eager nodes; the layer norm's M2 buffer
    was tracked by Inductor to the RMS norm's rsqrt, and the eager node
    computed that instead (a wrong answer).  A welford buffer is always
    computed from its reduction's op."""

    def fn(v0, v2, v4, v5):
        v1 = v0.repeat_interleave(2, dim=0)
        v3 = (v1 * torch.rsqrt(v1.pow(2).mean([-1], keepdim=True) + 1e-6)) * v2
        return F.layer_norm(v3, (9,), v4, v5, 1e-5)

    g = torch.Generator().manual_seed(805763)
    v0 = torch.rand(9, 2, generator=g) * 4 - 2
    v2, v4 = torch.rand(1, generator=g) + 0.5, torch.rand(9, generator=g) + 0.5
    v5 = torch.rand(9, generator=g) - 0.5
    _check(fn, lambda d: v0.to(d).transpose(0, 1), lambda d: v2.to(d).expand(9), v4, v5)


def test_a_host_node_reads_a_graph_input_from_its_first_element():
    """Seed 807679: ``x.index_add(2, idx, s) + v[1:2]``.  The add ran as a host
    node from the IR (the scatter wrote its input in place first), which
    indexes a graph input from its first element; the host copy was laid out
    from the storage's start, so ``v[1:2]`` read the element before it (a
    wrong answer)."""

    def fn(v0, v1, v2, v4):
        return (v0.index_add(2, v1, v2) + v4).unsqueeze(1)

    g = torch.Generator().manual_seed(807679)
    v0 = torch.rand(1, 8, 5, 7, generator=g) * 4 - 2
    v1 = torch.randint(0, 5, (1,), generator=g)
    v2 = torch.rand(1, 8, 2, 7, generator=g) * 4 - 2
    v4 = torch.rand(4, generator=g) * 4 - 2
    _check(fn, v0, v1, lambda d: v2.to(d)[:, :, ::2], lambda d: v4.to(d)[1:2])


@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (2, 3, 4, 8)], ids=["seed", "wider"])
def test_a_flat_read_across_three_dims_reads_every_element(shape):
    """Seed 904073: ``log_softmax(x.flatten(1, 3))`` of a [1, 2, 2, 2] input.
    The reduction's variable (range 8) reads the input one dim per piece, as
    factor sizes [2, 2, 2]; the split dropped its innermost piece and iterated
    [2, 2], so the max and the sum saw half the row (a wrong answer)."""

    def fn(v0):
        return F.log_softmax(v0.flatten(1, 3), dim=-1), v0.flatten(1, 3).sum(-1)

    g = torch.Generator().manual_seed(904073)
    _check(fn, torch.rand(*shape, generator=g) * 4 - 2)


@pytest.mark.parametrize("write", ["index_put", "index_copy"])
def test_a_row_write_into_a_dense_copy_of_a_strided_slice(write):
    """Routing seed 246: ``x[:, :, 1:2:3].index_put((idx,), v)``.  The write
    goes into a dense copy of the slice (``passes._index_put_in_place``),
    which Inductor lays out with a stride of 17 on its size-1 dim; the
    in-place ``spyre::index_put_`` asked for its FX value's stride order, and
    Inductor's write-back of the re-laid copy into the written buffer made a
    buffer that loads from itself (the compile aborted: ``KeyError: 'op2'``
    in the scheduler).  The op's eager kernel writes any strides: the written
    tensor is left unconstrained (``implicit_fallbacks``)."""

    def fn(v0, v2, v3):
        v1 = v0[:, :, 1:2:3]
        if write == "index_put":
            return v1.index_put((v2,), v3, accumulate=False)
        return v1.index_copy(0, v2, v3) * 2

    g = torch.Generator().manual_seed(246)
    v0 = torch.rand(65, 17, 2, generator=g) * 4 - 2
    v2 = torch.rand(65, generator=g).argsort(dim=0)[:3]
    v3 = torch.rand(1, 17, 3, generator=g) * 4 - 2
    _check(fn, v0, v2, lambda d: v3.to(d).transpose(0, 2))


@pytest.mark.parametrize(
    "name",
    ["sdpa_default_scale", "cat_last_dim", "pad_last_dim", "index_put"],
)
def test_symbolic_sizes_compile_to_the_cpu_answer(name):
    """``dynamic=True`` (every size symbolic, as automatic dynamic shapes makes
    them on a recompile): the sizes are specialised and the answer is the
    CPU's.  Each case failed in the first ``--dynamic`` runs: SDPA's default
    scale 1/sqrt(E) became 0 (long seed 1094, **a silent wrong answer**); a
    cat's and a pad's lane tables (CI seeds 34, 38, ...), an eager
    index_put's origin (CI seed 121) and the host path (long seeds 2152,
    2173, ...) refused symbolic sizes.  fp32: tight."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 16, 48, generator=g), torch.randn(1, 16, 48, generator=g)
    v = torch.randn(1, 16, 4, generator=g)
    cases = {
        "sdpa_default_scale": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v)),
        "cat_last_dim": (lambda a, b: torch.cat([a * 2, b.exp()], dim=-1), (q, v)),
        "pad_last_dim": (lambda a: F.pad(a.tanh(), (3, 2), value=0.5), (v,)),
        "index_put": (
            lambda x, i, y: torch.ops.aten.index_put(x, [None, i], y, True).sin(),
            (q[0], torch.tensor([3, 3, 40]), torch.randn(16, 3, generator=g)),
        ),
    }
    fn, args = cases[name]
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, dynamic=True)(*[a.to("spyre") for a in args])
    torch.testing.assert_close(got.cpu(), fn(*args))


def test_in_place_write_on_a_view_of_an_input_under_symbolic_sizes():
    """Long seed 3102 (``--dynamic``), minimised: ``index_put`` on a
    transposed slice of an input (a storage offset of 2) is made in place on
    a copy of the input's storage and read back at the slice's offset, an
    ``aten.sym_storage_offset`` node under dynamic shapes, which Inductor has
    no lowering for: its value reached ``as_strided`` as 0 and the answer was
    read from the wrong elements, **a silent wrong answer**
    (``compiler._register_storage_offset_lowering``).  fp32: exact."""
    g = torch.Generator().manual_seed(3102)
    base = torch.rand(5, 1, 1, 2, generator=g) * 4 - 2
    idx = torch.tensor([1])
    vals = torch.rand(1, 2, 2, 1, generator=g) * 4 - 2

    def fn(x, i, v):
        return x.transpose(3, 2).index_put((i,), v, accumulate=False)

    want = fn(base[1:3], idx, vals[:, ::2])
    torch._dynamo.reset()
    dev, dvals = base.to("spyre"), vals.to("spyre")
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    got = compiled(dev[1:3], idx.to("spyre"), dvals[:, ::2])
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_eager_write_into_a_view_of_an_input_under_symbolic_sizes():
    """Long seed 4077 (``--dynamic``), minimised: ``v0.unsqueeze(0)
    .index_copy(2, ...)`` with the view also returned runs as an eager node
    whose written copy is the view's value; under dynamic shapes the copy's
    FX node was not recognised (its size printed as 130, the buffer's as
    ``s18``), so the node re-ran the unsqueeze on the copy and the write
    failed on a 4-d tensor.  Sizes are compared as ints.  fp32: exact."""
    g = torch.Generator().manual_seed(4077)
    x = torch.rand(130, 96, generator=g) * 4 - 2
    idx = torch.tensor([5, 70])
    v = torch.rand(1, 130, 2, generator=g) * 4 - 2

    def fn(x, i, v):
        view = x.unsqueeze(0)
        return view, view.index_copy(2, i, v)

    want = fn(x, idx, v)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, dynamic=True)(*(t.to("spyre") for t in (x, idx, v)))
    for w, o in zip(want, got):
        torch.testing.assert_close(o.cpu(), w, rtol=0, atol=0)


def test_size_arithmetic_on_specialised_sizes_under_symbolic_sizes():
    """Long seed 5490 (``--dynamic``), minimised: a cat of a slice and its
    tensor (its lane tables specialise the sizes), then ``torch.roll``, whose
    index arithmetic (``operator.mod`` of sizes) re-propagated to plain ints;
    Inductor's lowering of ``mod`` computes with sympy and failed on ints (an
    aborted compile).  Plain ints are computed with the operator
    (``compiler._register_plain_scalar_arithmetic``).  fp32: exact."""
    x = torch.rand(1006, generator=torch.Generator().manual_seed(5490)) * 4 - 2

    def fn(v):
        return torch.roll(torch.cat([v[1005:], v], dim=0), -1, 0)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, dynamic=True)(x.to("spyre"))
    torch.testing.assert_close(got.cpu(), fn(x), rtol=0, atol=0)


def test_index_copy_with_a_view_of_its_tensor_returned():
    """Long seed 6289 (found by ``--dynamic``; also static), minimised: ``v =
    maximum(x, x)``, a slice of ``v`` returned and ``v.index_copy(1, ...)``:
    Inductor's reinplacing (torch 2.13, on its CPU backend too) made the
    functional ``index_put`` write ``v`` in place, and the slice returned
    read the written values, **a silent wrong answer**.  The functional op
    writes its own copy (``passes._index_put_in_place``).  fp32: exact."""
    g = torch.Generator().manual_seed(6289)
    x = torch.rand(31, 96, generator=g) * 4 - 2
    idx = torch.rand(96, generator=g).argsort()[:7]
    vals = torch.rand(31, 7, generator=g) * 4 - 2

    def fn(x, i, v):
        m = torch.maximum(x, x)
        return m[:, 27:75][7:24], m.index_copy(1, i, v)

    for dynamic in (False, True):
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, dynamic=dynamic)(
            *(t.to("spyre") for t in (x, idx, vals))
        )
        for w, o in zip(fn(x, idx, vals), got):
            torch.testing.assert_close(o.cpu(), w, rtol=0, atol=0)
