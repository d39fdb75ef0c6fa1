"""The pieces of vLLM's Mamba-2 layers on the card (vllm_plugin/mamba.py)."""

from __future__ import annotations

import torch

import torch_spyre
from torch_spyre.vllm_plugin import mamba


def test_padded_prefill_batch_equals_each_sequence():
    """Sequences of different lengths in one ``ssd_chunk_scan`` batch, padded
    with ``dt = PAD_DT``: each one's outputs and final state equal a scan of it
    alone (the padding leaves the state unchanged), initial states included."""
    g = torch.Generator().manual_seed(0)
    h, p, n, groups = 4, 16, 8, 1
    lens, s = [3, 9, 5], 9
    a = -torch.rand(h, generator=g) - 0.5
    d, bias = torch.randn(h, generator=g), torch.randn(h, generator=g)
    x = torch.randn(3, s, h, p, generator=g)
    dt = torch.randn(3, s, h, generator=g)
    b = torch.randn(3, s, groups, n, generator=g)
    c = torch.randn(3, s, groups, n, generator=g)
    init = torch.randn(3, h, p, n, generator=g)
    valid = torch.arange(s)[None, :] < torch.tensor(lens)[:, None]
    dt_pad = torch.where(valid[..., None], dt, torch.full_like(dt, mamba.PAD_DT))

    def on_card(*ts):
        return [t.to("spyre") for t in ts]

    torch_spyre.reset_fallback_counts()
    y, final = torch.ops.spyre.ssd_chunk_scan(
        *on_card(x, dt_pad, a, b, c, d, bias, init), 4, 0.0, float("inf")
    )
    assert torch_spyre.fallback_counts() == {}
    y, final = y.cpu(), final.cpu()
    for r, m in enumerate(lens):
        y1, f1 = torch.ops.spyre.ssd_chunk_scan(
            x[r : r + 1, :m], dt[r : r + 1, :m], a, b[r : r + 1, :m], c[r : r + 1, :m],
            d, bias, init[r : r + 1], 4, 0.0, float("inf"),
        )  # fmt: skip
        torch.testing.assert_close(y[r, :m], y1[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[r], f1[0], rtol=1e-4, atol=1e-4)


def test_registered_for_vllm():
    """vLLM builds our mixer, gated norm and Mamba2 backend (public hooks)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    mamba.register()
    assert op_registry_oot["MambaMixer2"] is mamba.SpyreMambaMixer2
    assert op_registry_oot["Mixer2RMSNormGated"] is mamba.SpyreMixer2RMSNormGated
    assert MambaAttentionBackendEnum.MAMBA2.get_class() is mamba.SpyreMamba2AttentionBackend


@torch.library.custom_op("spyre_test::mutate", mutates_args=("h",))
def _mutate(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    h.mul_(2)
    return h + 1


@_mutate.register_fake
def _(h, r):
    return torch.empty_like(h)


def test_mutated_input_clone_compiles(spyre_settings):
    """vLLM's Granite 4 layers run ``moe(h.clone()) + shared_mlp(h)``:
    ``op_mutating(y.clone())`` with ``y`` read afterwards compiles to
    Inductor's ``clone_preserve_strides``, a copy through a flat 1-D view of
    the [tokens, hidden] buffer.  The planner splits the flat variable at the
    buffer's dims (compiler/nodes.py ``_crossings``): one kernel program, no
    degrade step (``compile_fallback=error``)."""
    spyre_settings(compile_fallback="error")

    def f(x, w, wr):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return _mutate(y.clone(), y @ wr.t()) + y

    args = [torch.randn(16, 128), torch.randn(128), torch.randn(4, 128)]
    with torch.inference_mode():
        out = torch.compile(f, dynamic=False)(*[t.to("spyre") for t in args])
    torch.testing.assert_close(out.cpu(), f(*args), rtol=1e-4, atol=1e-4)
