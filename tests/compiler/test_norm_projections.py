"""An RMS norm and the projections that read it as one kernel program
(``spyre::norm_projections``, ``compiler/projection_fusion.py``): an
attention block's Q, K and V projections of the normed residual stream read
it once, and the normed rows never reach device memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch_spyre.compiler import scheduling
from torch_spyre.ir import Load, ProgramError, Store
from torch_spyre.kernels import options
from torch_spyre.kernels.projections import best_norm_projections, norm_projections
from torch_spyre.ops.mlp import rms_norm
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats
from torch_spyre.sim import estimate, execute
from torch_spyre.testing import tolerances

H = torch.float16


def _qkv(s, nw, wq, wk, wv):
    """An attention block's first half: the norm, then Q, K and V."""
    x = rms_norm(s, nw, 1e-5)
    return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)


def _args(lead, k, widths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(*lead, k, generator=g).to(dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    ws = [(torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype) for n in widths]
    return [s, nw, *ws]


def _compiled(fn, args, prepare=None):
    """(outputs, kernel names of a profiled second call) of ``fn`` compiled
    (``prepare``: run first, e.g. a module's move to the card)."""
    torch._dynamo.reset()
    scheduling.PLANS.clear()
    if prepare is not None:
        prepare()
    dev = [a.to("spyre") for a in args]
    with torch._inductor.config.patch(fx_graph_cache=False):
        cf = torch.compile(fn, fullgraph=True, dynamic=False)
        dispatch_stats.reset("fallback")
        cf(*dev)
        with profile() as prof:
            out = cf(*dev)
    assert dispatch_stats.counts("fallback") == {} and prof.fallbacks == {}
    return out, [k.name for k in prof.kernels]


@pytest.mark.parametrize(
    "lead,dtype", [((1, 64), H), ((2, 40), H), ((96,), torch.float32)], ids=str
)
def test_norm_and_qkv_projections_are_one_program(lead, dtype):
    """Q (4 query heads per KV head), K and V of the normed stream: one
    program, no norm kernel; each output equals the CPU's (fp32: to the
    summation order)."""
    args = _args(lead, 128, (256, 64, 64), dtype)
    out, names = _compiled(_qkv, args)
    assert names == ["projections_" + f"{math.prod(lead)}x128x256_64_64_norm"], names
    want = _qkv(*args)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    for o, w in zip(out, want):
        torch.testing.assert_close(o.cpu(), w, **tol)


def test_a_decode_step_keeps_its_projections_apart():
    """Fewer than 64 rows (a decode step's batch): the matmul planner's
    weight-streaming programs, the norm a kernel of its own."""
    args = _args((4, 1), 128, (256, 64, 64), H)
    out, names = _compiled(_qkv, args)
    assert not any(n.startswith("projections_") for n in names), names
    for o, w in zip(out, _qkv(*args)):
        torch.testing.assert_close(o.cpu(), w, **tolerances(H))


def test_a_norm_read_by_anything_else_keeps_its_kernel():
    """The normed rows are also returned: they must reach device memory, so
    the norm keeps its kernel and the projections their matmuls."""

    def fn(s, nw, wq, wk, wv):
        x = rms_norm(s, nw, 1e-5)
        return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv), x

    args = _args((1, 64), 128, (256, 64, 64), H)
    out, names = _compiled(fn, args)
    assert not any(n.startswith("projections_") for n in names), names
    for o, w in zip(out, fn(*args)):
        torch.testing.assert_close(o.cpu(), w, **tolerances(H))


def test_unfused_planning_keeps_the_projections_apart():
    args = _args((1, 64), 128, (256, 64, 64), H)
    with options.planning(fusion=False):
        _, names = _compiled(_qkv, args)
    assert not any(n.startswith("projections_") for n in names), names


@pytest.mark.parametrize(
    "b,m,split,tb,norm,dacc",
    [(1, 5, (1, 1, 2, 2), 1, True, False), (2, 3, (2, 1, 1, 2), 1, True, False),
     (2, 4, (1, 2, 2, 1), 2, False, False), (1, 5, (1, 1, 1, 2), 1, True, True),
     (2, 4, (1, 2, 1, 1), 1, False, True)],
    ids=str,
)  # fmt: skip
def test_projection_plans_compute_every_block(b, m, split, tb, norm, dacc):
    """Every plan shape against the CPU: k over cores (the partial sums and
    the norm's sum of squares all-reduced), the column block split, a batch
    tile, the accumulators double buffered; each of Q's four row blocks
    stored at its column offset."""
    k, widths = 256, (512, 128, 128)
    s, nw, *ws = _args((b, m), k, widths, H, seed=3)
    p = norm_projections(
        b, m, k, widths, H, norm_eps=1e-5 if norm else None, split=split, tiles=(m, 64, 64),
        tb=tb, double_acc=dacc,
    )  # fmt: skip
    assert all(x.double_buffered == dacc for x in p.buffers if x.name.startswith("a"))
    p.validate()
    # the activation read once; Q's weight read as four row blocks
    assert [x.operand for x in p.steps if isinstance(x, Load)].count("x") == 1
    assert sorted(x.offsets for x in p.steps if isinstance(x, Load) and x.operand == "w0") == [
        (r * 128, 0) for r in range(4)
    ]
    assert len([x for x in p.steps if isinstance(x, Store)]) == 6
    host = {"x": s, "nw": nw, **{f"w{i}": w for i, w in enumerate(ws)}}
    bufs = {o.name: o.layout.to_device(host[o.name]) for o in p.operands if o.name in host}
    for i in range(3):
        lay = p.operand(f"out{i}").layout
        bufs[f"out{i}"] = torch.zeros(lay.device_size, dtype=lay.dtype)
    execute(p, bufs)
    h = rms_norm(s, nw, 1e-5) if norm else s
    for i, w in enumerate(ws):
        got = p.operand(f"out{i}").layout.to_host(bufs[f"out{i}"])
        torch.testing.assert_close(got, F.linear(h.double(), w.double()).to(H), **tolerances(H))


def test_widths_without_a_common_block_are_refused():
    with pytest.raises(ProgramError, match="common block"):
        norm_projections(1, 4, 128, (192, 128), H)


def test_the_eager_op_without_a_norm_runs_one_program():
    s, _, *ws = _args((3, 7), 128, (128, 128), H, seed=4)
    dispatch_stats.reset("kernel")
    out = torch.ops.spyre.norm_projections(s.to("spyre"), None, 0.0, [w.to("spyre") for w in ws])
    assert dispatch_stats.counts("kernel") == {"norm_projections": 1}
    for o, w in zip(out, ws):
        torch.testing.assert_close(o.cpu(), F.linear(s, w), **tolerances(H))


def _rotate_half(t):
    return torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), -1)


@pytest.mark.parametrize(
    "b,m,split,cb,rope,first,batched,norm",
    [(1, 5, (1, 1, 2, 2), 1, (1, 1, 0), (1, 1, 1), True, (0, 0, 0)),
     (2, 3, (2, 1, 1, 2), 2, (1, 1, 0), (1, 0, 1), True, (1, 1, 0)),
     (2, 4, (1, 2, 2, 1), 1, (0, 1, 0), (0, 1, 1), True, (0, 1, 1)),
     (1, 6, (1, 2, 1, 2), 1, (1, 0, 1), (0, 0, 0), False, (1, 0, 0))],
    ids=str,
)  # fmt: skip
def test_head_projections_rotate_and_lay_out_every_block(
    b, m, split, cb, rope, first, batched, norm
):
    """``heads``: each head's halves accumulated apart, a per-head RMS norm
    (sum of squares over the halves' sticks, then the halves) and RoPE as
    the tile's epilogue (``rotate_half`` of the halves, then ``* sin + o *
    cos``) after the k split's all-reduce, stored heads-first or
    token-major; against the CPU's ``o * cos + rotate_half(o) * sin`` in
    float64."""
    from torch_spyre.kernels.projections import Heads

    k, widths, hd = 256, (512, 128, 128), 128
    s, nw, *ws = _args((b, m), k, widths, H, seed=5)
    g = torch.Generator().manual_seed(6)
    cos, sin = (torch.randn(cb, m, hd, generator=g).to(H) for _ in range(2))
    hns = [(1 + 0.2 * torch.randn(hd, generator=g)).to(H) for _ in widths]
    heads = Heads(
        hd, tuple(map(bool, rope)), tuple(map(bool, first)), cb, tuple(map(bool, norm)), 1e-6
    )
    p = norm_projections(
        b, m, k, widths, H, norm_eps=1e-5, split=split, tiles=(m, 1, 64), heads=heads,
        batched=batched,
    )  # fmt: skip
    p.validate()
    # the halves of a head are one tile; one store per block, no lane shuffle
    assert len([x for x in p.steps if isinstance(x, Store)]) == 6
    host = {"x": s if batched else s[0], "nw": nw, "cos": cos if batched else cos[0]}
    host |= {"sin": sin if batched else sin[0], **{f"w{i}": w for i, w in enumerate(ws)}}
    host |= {f"hn{i}": w for i, w in enumerate(hns)}
    bufs = {}
    for o in p.operands:
        if o.name in host:
            bufs[o.name] = o.layout.to_device(host[o.name].reshape(o.layout.host_size))
        else:
            bufs[o.name] = torch.zeros(o.layout.device_size, dtype=o.layout.dtype)
    execute(p, bufs)
    h = rms_norm(s, nw, 1e-5).double()
    for i, w in enumerate(ws):
        want = F.linear(h, w.double()).view(b, m, -1, hd)
        if norm[i]:
            want = rms_norm(want, hns[i].double(), 1e-6)
        at = 2
        if first[i]:
            want, at = want.transpose(1, 2), 1
        if rope[i]:
            c, sn = cos.double().unsqueeze(at), sin.double().unsqueeze(at)
            want = want * c + _rotate_half(want) * sn
        got = p.operand(f"out{i}").layout.to_host(bufs[f"out{i}"]).reshape(want.shape)
        torch.testing.assert_close(got, want.to(H), **tolerances(H))


def test_rotate_half_needs_a_dim_of_two_that_is_not_the_stick():
    from torch_spyre.ir import Buffer, Dim, Operand, Program, Vector
    from torch_spyre.layout import SpyreTensorLayout

    def prog(dim):
        lay = SpyreTensorLayout.default((2, 64), H)
        return Program(
            name="rot",
            dims=(Dim("j", 2), Dim("e", 64)),
            operands=(Operand("x", lay), Operand("y", lay, "output")),
            buffers=(Buffer("a", ("j", "e")), Buffer("r", ("j", "e"))),
            steps=(Load("a", "x", ("j", "e")), Vector("rotate_half", "r", ("a",), dim=dim),
                   Store("y", "r", ("j", "e"))),
        )  # fmt: skip

    x = torch.randn(2, 64).to(H)
    p = prog("j")
    p.validate()
    lay = p.operand("x").layout
    bufs = {"x": lay.to_device(x), "y": torch.zeros(lay.device_size, dtype=H)}
    execute(p, bufs)
    torch.testing.assert_close(lay.to_host(bufs["y"]), torch.stack((-x[1], x[0])))
    for bad in ("e", None):
        with pytest.raises(ProgramError, match="rotate_half"):
            prog(bad).validate()


def _attention(s, nw, wq, wk, wv, cos, sin):
    """An attention block's first half as transformers' Llama writes it:
    the norm, Q, K and V split into heads of cos's size, RoPE on Q and K,
    causal attention with grouped KV heads, token-major out."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, n = s.shape[:2]
    hd = cos.shape[-1]
    x = rms_norm(s, nw, 1e-5)
    q, k, v = (F.linear(x, w).view(b, n, -1, hd).transpose(1, 2) for w in (wq, wk, wv))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize(
    "dtype,b,cb,hd",
    [(H, 2, 2, 128), (torch.float32, 2, 1, 128), (torch.bfloat16, 1, 1, 256)],
    ids=str,
)
def test_an_attention_blocks_rope_and_head_split_are_the_projections_epilogue(dtype, b, cb, hd):
    """Q and K rotated and every output stored heads-first by the one
    projections program, read as they lie by flash attention: no RoPE
    program, no re-lay of Q, K or V; the output equals the CPU's (fp32: to
    the summation order).  Rotary tables per sequence or one for the batch;
    heads of 128 and of 256 (a half of two sticks)."""
    s, nw, *ws = _args((b, 64), 256, (2 * hd, hd, hd), dtype)
    g = torch.Generator().manual_seed(7)
    ang = torch.randn(cb, 64, hd // 2, generator=g)
    cos, sin = (torch.cat((t, t), -1).to(dtype) for t in (ang.cos(), ang.sin()))
    args = [s, nw, *ws, cos, sin]
    out, names = _compiled(_attention, args)
    assert names[0] == f"projections_{b * 64}x256x{2 * hd}_{hd}_{hd}_norm_rope_bhsd", names
    assert len(names) == 2 and names[1].startswith(f"flash_attn_{b}x2x64x64x{hd}_causal"), names
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    torch.testing.assert_close(out.cpu(), _attention(*args), **tol)


def _vllm_head(x, res, nw, wqkv, cos_t, sin_t, pos):
    """vLLM's attention block head as our plugin runs it (token-major rows
    [t, k]): the fused residual add and RMS norm (``SpyreRMSNorm``), one
    merged QKV projection split into Q, K and V, and ``SpyreRotary``'s
    rotation of Q and K by cos/sin rows gathered by position."""
    hd = cos_t.shape[-1]
    s = x + res
    h = rms_norm(s, nw, 1e-5)
    nq = wqkv.shape[0] // 2  # Q: half the rows (K and V a quarter each)
    q, k, v = F.linear(h, wqkv).split([nq, nq // 2, nq // 2], dim=-1)
    cos = F.embedding(pos, cos_t)[:, None, :]
    sin = F.embedding(pos, sin_t)[:, None, :]

    def rotate(t):
        shape = t.shape
        t = t.view(t.shape[0], -1, hd)
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return (t * cos + torch.cat([-t2, t1], dim=-1) * sin).reshape(shape)

    return rotate(q), rotate(k), v, s


def test_the_row_blocks_of_one_weight_are_read_in_place():
    """The op given three consecutive row slices of one weight (vLLM's
    ``qkv_proj`` split apart) binds the weight once and reads each block
    through row offsets: no re-lay of a slice, one operand ``w``; fp32
    equal to the CPU to the summation order."""
    s, nw, w = _args((96,), 256, (512,), torch.float32)
    ws_host = list(w.split((256, 128, 128), 0))
    want = torch.ops.spyre.norm_projections(s, nw, 1e-5, ws_host)
    dev = [a.to("spyre") for a in (s, nw, w)]
    dispatch_stats.reset("kernel")
    with profile() as prof:
        out = torch.ops.spyre.norm_projections(
            dev[0], dev[1], 1e-5, list(dev[2].split((256, 128, 128), 0))
        )
    assert dispatch_stats.counts("kernel") == {"norm_projections": 1}
    assert [t.kind for t in prof.transfers if t.kind == "d2d"] == []
    from torch_spyre.runtime import launch

    (prog,) = {
        k.program
        for k in launch._cache.values()
        if k.program and k.program.name == prof.kernels[0].name
    }
    assert {o.name for o in prog.operands if o.name.startswith("w")} == {"w"}
    for got, ref in zip(out, want):
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [H, torch.float32], ids=str)
def test_vllms_merged_qkv_and_rotary_are_the_projections_program(dtype):
    """vLLM's form (rows, one merged ``qkv_proj`` split apart, the rotary
    over position-gathered rows) reaches the same program as transformers':
    the norm, Q, K and V read as row blocks of the one weight in place (no
    copy of it), Q and K rotated in the epilogue and stored token-major; the
    add (the residual stream, an output) and the two table gathers are the
    only other kernels (the split's copies, the rotation's programs gone).
    Equal to the CPU (fp32: to the summation order)."""
    t, k, hd = 96, 256, 128
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(t, k, generator=g).to(dtype) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    wqkv = (torch.randn(4 * hd, k, generator=g) / math.sqrt(k)).to(dtype)  # 2 + 1 + 1 heads
    ang = torch.randn(512, hd // 2, generator=g)
    cos_t, sin_t = (torch.cat((a, a), -1).to(dtype) for a in (ang.cos(), ang.sin()))
    pos = torch.randperm(512, generator=g)[:t]
    args = [x, res, nw, wqkv, cos_t, sin_t, pos]
    with profile() as prof:
        out, names = _compiled(_vllm_head, args)
    assert f"projections_{t}x{k}x{2 * hd}_{hd}_{hd}_norm_rope" in names, names
    assert not any(n.startswith(("mm", "fused_clone", "fused_mm")) for n in names), names
    assert [x.kind for x in prof.transfers if x.kind == "d2d"] == []
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    for got, want in zip(out, _vllm_head(*args)):
        torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.parametrize(
    "arch,tag", [("Llama", "_norm_rope_bhsd"), ("Qwen3", "_norm_qknorm_rope_bhsd")]
)
def test_a_llama_model_compiles_its_rope_into_the_projections(arch, tag):
    """A two-layer Llama (4 query heads of 128 over 2 KV heads) at 64
    tokens: each layer's attention half is the projections program and flash
    attention, and the logits equal the CPU model's (fp32: to the
    summation order).  Qwen3: its per-head q_norm and k_norm before RoPE
    are the program's too."""
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).float().eval()
    ids = torch.randint(0, 128, (2, 64))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        out, names = _compiled(
            lambda i: model(i, use_cache=False).logits, [ids], prepare=lambda: model.to("spyre")
        )
    rope = [n for n in names if n.endswith(tag)]
    assert len(rope) == 2 and not any("mm_add_attention" in n for n in names), names
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)


def test_q_and_k_rotated_by_different_tables_keep_their_rope_programs():
    """Two rotary tables (not one pair for every output): the rotations stay
    Inductor's programs (reading Q and K token-major, as the rotation's
    matmul views them); V, returned, keeps its token-major layout too (a
    graph output has eager's strides: heads-first would cost a copy)."""

    def two_tables(s, nw, wq, wk, wv, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, n = s.shape[:2]
        x = rms_norm(s, nw, 1e-5)
        q, k, v = (F.linear(x, w).view(b, n, -1, 128).transpose(1, 2) for w in (wq, wk, wv))
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, _ = apply_rotary_pos_emb(k, k, sin, cos)
        return q, k, v

    s, nw, *ws = _args((1, 64), 256, (512, 256, 256), H)
    g = torch.Generator().manual_seed(8)
    cos, sin = (torch.randn(1, 64, 128, generator=g).to(H) for _ in range(2))
    args = [s, nw, *ws, cos, sin]
    out, names = _compiled(two_tables, args)
    assert names[0] == "projections_64x256x512_256_256_norm" and len(names) > 1, names
    for o, w in zip(out, two_tables(*args)):
        torch.testing.assert_close(o.cpu(), w, **tolerances(H))


def test_the_eager_op_rotates_and_lays_out_heads():
    """``spyre::norm_projections`` with heads (Q head-normed, Q and K
    rotated) on the card equals its CPU reference (the op's own composite),
    one program."""
    s, nw, *ws = _args((2, 5), 256, (512, 128, 128), H, seed=9)
    g = torch.Generator().manual_seed(10)
    cos, sin = (torch.randn(1, 5, 128, generator=g).to(H) for _ in range(2))
    qn = (1 + 0.2 * torch.randn(128, generator=g)).to(H)
    kw = dict(head_dim=128, rope=[True, True, False], heads_first=[True, False, True])
    kw |= dict(head_normed=[True, False, False], head_norm_eps=1e-6)
    want = torch.ops.spyre.norm_projections(s, nw, 1e-5, ws, cos, sin, head_norms=[qn], **kw)
    d = [t.to("spyre") for t in (s, nw, cos, sin)]
    dispatch_stats.reset("kernel")
    got = torch.ops.spyre.norm_projections(
        d[0], d[1], 1e-5, [w.to("spyre") for w in ws], d[2], d[3], head_norms=[qn.to("spyre")],
        **kw,
    )  # fmt: skip
    assert dispatch_stats.counts("kernel") == {"norm_projections": 1}
    assert [tuple(o.shape) for o in want] == [(2, 4, 5, 128), (2, 5, 128), (2, 1, 5, 128)]
    for o, w in zip(got, want):
        torch.testing.assert_close(o.cpu(), w, **tolerances(H))
    with pytest.raises(ValueError, match="one rope and layout flag per weight"):
        torch.ops.spyre.norm_projections(s, nw, 1e-5, ws, cos, sin, 128, [True], [True])


def test_granite_8b_prefill_projections_beat_the_kernels_they_replace():
    """Granite-3.3-8B at 1,024 rows: one program for the norm and Q, K, V
    (647.6 us) against the norm pass and three matmuls it replaces (147.5 +
    442.4 + 2 x 170.3 us, `spyre estimate --explain` before), and within
    1.25x of its roof and 1.1x of its floor (the activation block each core
    loads before the weights stream is the gap)."""
    p = best_norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, norm_eps=1e-5)
    r = estimate(p)
    assert r.time_s < 0.8 * (147.5 + 442.4 + 2 * 170.3) * 1e-6
    assert r.time_s < 1.25 * r.roofline_time_s and r.time_s < 1.1 * r.sustained_roof_s


def test_double_buffered_accumulators_overlap_the_stores():
    """The same plan with its accumulators double buffered: the stores of a
    column block overlap the next block's weight stream instead of
    stalling it (Granite-3.3-8B, 1,024 rows: 723.0 us single buffered, the
    search's plan then; 647.6 us now), so the search keeps them where the
    LX holds them twice, and a plan whose LX cannot keeps single buffers."""
    plan = best_norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, norm_eps=1e-5)
    assert all(b.double_buffered for b in plan.buffers if b.name.startswith("a"))
    kw = dict(norm_eps=1e-5, split=(1, 32, 1, 1), tiles=(32, 128, 512))
    single = norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, **kw)
    double = norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, double_acc=True, **kw)
    assert estimate(double).time_s < estimate(single).time_s - 50e-6
    assert estimate(single).time_s == pytest.approx(723.0e-6, abs=0.1e-6)
    assert estimate(plan).time_s == pytest.approx(647.6e-6, abs=0.1e-6)


def test_granite_8b_prefill_projections_rotate_and_lay_out_for_13_us():
    """Granite-3.3-8B at 1,024 rows with Q and K rotated and all three stored
    heads-first: 661.1 us, 13.5 us more than the plain program (647.6 us),
    where the programs it replaces took 156.3 (Q's RoPE), 64.1 (K's RoPE
    and cache layout) and 37.4 us (V's re-lay) (`spyre estimate --explain`
    before); within 1.1x of its floor."""
    from torch_spyre.kernels.projections import Heads

    heads = Heads(128, (True, True, False), (True, True, True))
    p = best_norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, norm_eps=1e-5, heads=heads)
    r = estimate(p)
    assert r.time_s == pytest.approx(661.1e-6, abs=0.1e-6)
    assert r.time_s < 1.1 * r.sustained_roof_s


@pytest.mark.parametrize("run", [1, 48])
def test_k_and_v_are_stored_into_their_cache_rows(run):
    """``Heads.cached``: K's and V's tiles stored heads-first into a cache
    operand [b, heads, L, d] at the rows a row table names (a negative one
    is not written), the other rows untouched; ``cache_run`` changes only
    the descriptors the timing model counts (runs of consecutive rows)."""
    from torch_spyre.kernels.projections import Heads

    b, m, k, widths, hd, length = 2, 48, 256, (512, 128, 128), 128, 80
    s, nw, *ws = _args((b, m), k, widths, H, seed=7)
    g = torch.Generator().manual_seed(8)
    cos, sin = (torch.randn(1, m, hd, generator=g).to(H) for _ in range(2))
    pos = torch.arange(20, 20 + m) if run > 1 else torch.randperm(length, generator=g)[:m]
    if run == 1:
        pos[5] = -1  # a padded row: not written
    heads = Heads(hd, (True, True, False), (True, True, True), 1, (), 0.0,
                  (False, True, True), length, run)  # fmt: skip
    p = norm_projections(b, m, k, widths, H, norm_eps=1e-5, split=(2, 8, 1, 2),
                         tiles=(6, 1, 64), heads=heads)  # fmt: skip
    p.validate()
    host = {"x": s, "nw": nw, "cos": cos, "sin": sin, "pos": pos.to(torch.int32)}
    host |= {f"w{i}": w for i, w in enumerate(ws)}
    old = [torch.randn(b, 1, length, hd, generator=g).to(H).expand(b, 1, length, hd)
           for _ in range(2)]  # fmt: skip
    host |= {"out1": old[0].contiguous(), "out2": old[1].contiguous()}
    bufs = {}
    for o in p.operands:
        src = host.get(o.name)
        bufs[o.name] = (
            o.layout.to_device(src.reshape(o.layout.host_size))
            if src is not None
            else torch.zeros(o.layout.device_size, dtype=o.layout.dtype)
        )
    execute(p, bufs)
    h = rms_norm(s, nw, 1e-5).double()
    c, sn = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    for i, w in enumerate(ws):
        want = F.linear(h, w.double()).view(b, m, -1, hd).transpose(1, 2)
        if i < 2:
            want = want * c + _rotate_half(want) * sn
        got = p.operand(f"out{i}").layout.to_host(bufs[f"out{i}"])
        got = got.reshape(b, -1, length if i else m, hd)
        if i == 0:
            torch.testing.assert_close(got, want.to(H), **tolerances(H))
            continue
        keep = pos >= 0
        torch.testing.assert_close(got[:, :, pos[keep]], want[:, :, keep].to(H), **tolerances(H))
        rest = torch.ones(length, dtype=torch.bool)
        rest[pos[keep]] = False
        assert torch.equal(got[:, :, rest], old[i - 1][:, :, rest])


def test_a_cached_output_must_be_heads_first():
    from torch_spyre.kernels.projections import Heads

    heads = Heads(128, (True, True, False), (True, False, True), 1, (), 0.0,
                  (False, True, True), 80)  # fmt: skip
    with pytest.raises(ProgramError, match="each cached output heads-first"):
        norm_projections(1, 64, 256, (512, 128, 128), H, heads=heads)


def _qkv_cache_args(dtype, s=64, length=100, hd=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, s, 256, generator=g).to(dtype)
    nw = (1 + 0.2 * torch.randn(256, generator=g)).to(dtype)
    wq, wk, wv = ((torch.randn(n * hd, 256, generator=g) / 16).to(dtype) for n in (4, 2, 2))
    kc, vc = (torch.randn(1, 2, length, hd, generator=g).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(1, s, hd, generator=g).to(dtype) for _ in range(2))
    return x, nw, wq, wk, wv, kc, vc, cos, sin


@pytest.mark.parametrize("dtype,start", [(torch.float32, 0), (H, 9)], ids=str)
def test_the_eager_op_writes_k_and_v_into_the_cache(dtype, start):
    """``spyre::norm_qkv_into_cache``: one program on the card, Q returned,
    K and V written into the caches at the positions (``index_copy_`` along
    dim 2), as the CPU composite does; fp32 to the summation order."""
    x, nw, wq, wk, wv, kc, vc, cos, sin = _qkv_cache_args(dtype)
    pos = torch.arange(start, start + 64)
    rope = [True, True, False]
    kw, vw = kc.clone(), vc.clone()
    q = torch.ops.spyre.norm_qkv_into_cache(x, nw, 1e-6, wq, wk, wv, kw, vw, pos, cos, sin, 128,
                                            rope)  # fmt: skip
    d = [t.to("spyre") for t in (x, nw, wq, wk, wv, kc, vc, pos, cos, sin)]
    dispatch_stats.reset()
    qd = torch.ops.spyre.norm_qkv_into_cache(d[0], d[1], 1e-6, *d[2:], 128, rope)
    assert dispatch_stats.counts() == {("kernel", "norm_projections"): 1}
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tolerances(dtype)
    for got, want in ((qd, q), (d[5], kw), (d[6], vw)):
        torch.testing.assert_close(got.cpu(), want, **tol)


def test_a_cache_position_out_of_range_is_an_index_error_and_writes_nothing():
    x, nw, wq, wk, wv, kc, vc, cos, sin = _qkv_cache_args(H)
    d = [t.to("spyre") for t in (x, nw, wq, wk, wv, kc, vc)]
    pos = torch.arange(50, 114).to("spyre")
    with pytest.raises(IndexError, match="cache position 113 is out of bounds for a cache of 100"):
        torch.ops.spyre.norm_qkv_into_cache(
            d[0], d[1], 1e-6, *d[2:], pos, cos.to("spyre"), sin.to("spyre"), 128,
            [True, True, False],
        )  # fmt: skip
    assert torch.equal(d[5].cpu(), kc) and torch.equal(d[6].cpu(), vc)


def test_a_llama_prefill_writes_its_cache_from_the_projections_program():
    """Through ``models.generate`` (transformers' StaticCache): each layer's
    K and V rows are stored into the cache by the projections program, no
    cache-write kernel runs in the prefill, and the logits equal the CPU
    model's (fp32)."""
    import copy

    import transformers

    from torch_spyre import models
    from torch_spyre.models.generate import generate
    from torch_spyre.runtime import launch

    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    dev = models.prepare(copy.deepcopy(ref), dtype=torch.float32, compile=True)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    launch.clear_cache()
    with torch._inductor.config.patch(fx_graph_cache=False), profile() as prof:
        got = generate(dev, ids, 3, keep_logits=True)
    want = generate(ref, ids, 3, keep_logits=True)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    cached = [k[-1] for k in launch._cache if isinstance(k, tuple) and k[0] == "norm_projections"]
    assert cached and all(h is not None and h.cached == (False, True, True) for h in cached)
    assert all(h.cache_run == 64 for h in cached)  # the prefill's positions are consecutive
    # the decode steps' one-row writes (1 x 2 heads x 128 x 4 B) remain; no
    # prefill write of 64 rows (65,536 B) runs
    puts = [k.name for k in prof.kernels if k.name.startswith("_index_put")]
    assert puts and all(n.endswith("_1024B") for n in puts), puts


def test_granite_8b_prefill_projections_write_the_cache_for_no_more():
    """Granite-3.3-8B at 1,024 rows: with K and V stored into their cache
    rows (consecutive: one descriptor a tile) the program takes what it did
    storing them to outputs of their own (661.2 against 661.1 us), and the
    two cache-write kernels after it (2 x 37.7 us, `spyre estimate
    --explain`) have nothing left to do; rows in no known order (one
    descriptor a row) cost 710.8 us."""
    from torch_spyre.kernels.projections import Heads

    def time_of(**cache):
        heads = Heads(128, (True, True, False), (True, True, True), 1, (), 0.0, **cache)
        p = best_norm_projections(1, 1024, 4096, (4096, 1024, 1024), H, norm_eps=1e-5,
                                  heads=heads)  # fmt: skip
        return estimate(p).time_s

    cached = dict(cached=(False, True, True), cache_len=1152)
    assert time_of() == pytest.approx(661.1e-6, abs=0.1e-6)
    assert time_of(**cached, cache_run=1024) == pytest.approx(661.2e-6, abs=0.1e-6)
    assert time_of(**cached, cache_run=1) == pytest.approx(710.8e-6, abs=0.1e-6)
