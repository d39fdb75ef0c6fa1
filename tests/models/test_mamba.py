"""Mamba-2 (Granite 4 hybrid) layers on the card: the SSD chunked scan, the decode
step and the gated norm as kernel programs, wired into the stock model."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf  # noqa: E402

import torch_spyre  # noqa: E402
import torch_spyre.models as models  # noqa: E402
from torch_spyre.kernels import ssd as sim_ssd  # noqa: E402
from torch_spyre.models import ssm as spyre_ssm  # noqa: E402
from torch_spyre.models.generate import generate  # noqa: E402
from torch_spyre.ops.ssm import scan_reference  # noqa: E402
from torch_spyre.runtime import dispatch_stats  # noqa: E402
from torch_spyre.runtime.fallback import fallback_policy  # noqa: E402
from torch_spyre.sim import get_card  # noqa: E402
from torch_spyre.testing import tolerances  # noqa: E402


def S(t):
    return None if t is None else t.to("spyre")


def _inputs(b, s, h, p, g, n, init, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(
        x=r(b, s, h, p),
        dt=r(b, s, h),
        A=-torch.rand(h, generator=gen) - 0.5,
        B=r(b, s, g, n),
        C=r(b, s, g, n),
        D=torch.rand(h, generator=gen),
        bias=torch.rand(h, generator=gen),
        init=r(b, h, p, n) if init else None,
    )


@pytest.mark.parametrize(
    "shape",
    [
        (1, 12, 4, 32, 1, 16, 8, False),
        (2, 20, 4, 16, 2, 8, 8, True),
        (1, 5, 2, 32, 1, 16, 256, False),
    ],
)
def test_ssd_chunk_scan_matches_transformers(shape):
    b, s, h, p, g, n, chunk, init = shape
    t = _inputs(b, s, h, p, g, n, init)
    want_y, want_state = hf.mamba2_chunk_scan(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=t["D"], dt_bias=t["bias"],
        initial_states=t["init"], dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    dispatch_stats.reset()
    with fallback_policy("error"):
        y, state = torch.ops.spyre.ssd_chunk_scan(
            S(t["x"]), S(t["dt"]), S(t["A"]), S(t["B"]), S(t["C"]), S(t["D"]), S(t["bias"]),
            S(t["init"]), chunk, 0.0, float("inf"),
        )  # fmt: skip
    assert dispatch_stats.counts("kernel").get("ssd_chunk_scan") == 1  # the program, not a detour
    tol = tolerances(torch.float32)
    torch.testing.assert_close(y.cpu(), want_y, **tol)
    torch.testing.assert_close(state.cpu(), want_state, **tol)
    # and the chunked form equals the recurrence written position by position
    dtd = torch.nn.functional.softplus(t["dt"] + t["bias"])
    ry, rs = scan_reference(t["x"], dtd, t["A"], t["B"], t["C"], t["D"], t["init"])
    torch.testing.assert_close(y.cpu(), ry, **tol)
    torch.testing.assert_close(state.cpu(), rs, **tol)


def test_state_passing_is_sequential_over_chunks():
    """Phase 2 walks the chunks in order: its vector work grows with the chunks
    and is not spread over cores along them; the scan dim is never split."""
    card = get_card(0)
    t = {
        c: [card.estimate(p) for p in sim_ssd.ssd_chunk_scan(1, c, 256, 1, 48, 64, 128).phases]
        for c in (4, 8)
    }
    vec4, vec8 = max(t[4][1].busy_s["vector"]), max(t[8][1].busy_s["vector"])
    assert vec8 == pytest.approx(2 * vec4)
    p2 = sim_ssd.ssd_chunk_scan(1, 8, 256, 1, 48, 64, 128).phases[1]
    assert p2.dim("c").cores == 1 and "scan" in p2.dump()


def test_decode_step_matches_transformers():
    b, h, p, n = 2, 4, 32, 16
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(b, h, p, n, generator=gen)
    x, dt = torch.randn(b, h, p, generator=gen), torch.randn(b, h, generator=gen)
    A, D, bias = (
        -torch.rand(h, generator=gen),
        torch.rand(h, generator=gen),
        torch.rand(h, generator=gen),
    )
    B, C = torch.randn(b, 1, n, generator=gen), torch.randn(b, 1, n, generator=gen)
    ref_state = state.clone()
    want = hf.mamba2_selective_state_update(
        ref_state, x, dt[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n), B, C,
        D[:, None].expand(h, p), dt_bias=bias[:, None].expand(h, p), dt_softplus=True,
    )  # fmt: skip
    dev_state = S(state)
    with fallback_policy("error"):
        got = torch.ops.spyre.ssm_step(dev_state, S(x), S(dt), S(A), S(B), S(C), S(D), S(bias))
    tol = tolerances(torch.float32)
    torch.testing.assert_close(got.cpu(), want, **tol)
    torch.testing.assert_close(dev_state.cpu(), ref_state, **tol)  # updated in place


def test_gated_norm_matches_transformers():
    norm = hf.GraniteMoeHybridRMSNormGated(64, 64, 1e-6)
    norm.weight.data = torch.rand(64)
    x, z = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    got = torch.ops.spyre.rmsnorm_gated(S(x), S(z), S(norm.weight.data), 1e-6).cpu()
    torch.testing.assert_close(got, norm(x, z), **tolerances(torch.float32))


def _hybrid():
    return transformers.GraniteMoeHybridConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=128,
    )  # fmt: skip


def test_stock_model_calls_the_cards_programs():
    """The patch wraps the modeling file's scan functions: if transformers stops
    calling them (a rename, a new code path), the counts below drop to zero."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_hybrid()).eval()
    dev = models.prepare(copy.deepcopy(ref))
    assert any("mamba2" in p for p in dev.spyre_patches)
    assert hasattr(hf.mamba2_chunk_scan, spyre_ssm._WRAPPED)
    assert any(isinstance(m, spyre_ssm.GatedRMSNorm) for m in dev.modules())
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    dispatch_stats.reset()
    torch_spyre.reset_fallback_counts()
    got = generate(dev, ids, 5)
    assert torch_spyre.fallback_counts() == {}
    kernels = dispatch_stats.counts("kernel")
    assert kernels.get("ssd_chunk_scan") == 1  # the prefill
    assert kernels.get("ssm_step") == 4  # each decode step, on the cache's state
    assert kernels.get("rmsnorm_gated") == 5
    assert kernels.get("convolution_overrideable.default") == 5  # the depthwise conv1d program
    want = generate(ref, ids, 5)
    assert torch.equal(got.tokens, want.tokens)
    # other devices keep the original functions' results
    with torch.no_grad():
        out = ref(ids).logits
    torch.testing.assert_close(dev(S(ids)).logits.cpu(), out, **tolerances(torch.float32))
