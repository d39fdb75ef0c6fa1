"""A matmul whose rows come in two dims (a ``[B, S, K]`` activation) may split
the inner one over cores.

``[B, S, K]`` is stored ``[S, K/64, B, 64]``: a slice of the outer batch dim
spans the whole activation (and output) in device memory, a slice of S is
contiguous.  The planner used to split only the outer row dim when it could
take the cores, so at batch 32 x 512 tokens x 8192 (256 MiB of activation)
no plan fitted a core's 256 MiB span and ``F.linear`` ran on the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_spyre
from torch_spyre.hardware import HardwareConfig
from torch_spyre.kernels import eager as programs
from torch_spyre.runtime import launch
from torch_spyre.runtime.fallback import fallback_policy
from torch_spyre.sim import execute, timing_only


def _dims(p) -> dict[str, tuple[int, int | None]]:
    return {d.name: (d.cores, d.tile) for d in p.dims}


def test_inner_row_split_plans_and_computes_under_a_small_span():
    """A card with a 160 KiB span per core: only a plan splitting S (and k)
    fits; it validates and computes the product."""
    cfg = HardwareConfig().replace(per_core_span_bytes=160 * 1024)
    b, s, k, n = 8, 64, 256, 512
    p = programs.matmul(
        (b, s, k), ("m0", "m1", "k"), (n, k), ("n", "k"), (b, s, n), ("m0", "m1", "n"),
        {"m0": b, "m1": s, "n": n, "k": k}, torch.float16, config=cfg,
    )  # fmt: skip
    p.validate(cfg)
    dims = _dims(p)
    assert dims["x1"][0] > 1  # S (the inner row dim) over cores
    assert dims["x0"][1] > 1  # and a tile of several batch rows per weight tile
    torch.manual_seed(0)
    x, w = torch.randn(b, s, k).half(), (torch.randn(n, k) / 16).half()
    bufs = {"a": p.operand("a").layout.to_device(x), "b": p.operand("b").layout.to_device(w)}
    out = p.operand("out").layout
    bufs["out"] = torch.zeros(out.device_size, dtype=out.dtype)
    execute(p, bufs)
    want = F.linear(x.double(), w.double()).half()
    torch.testing.assert_close(out.to_host(bufs["out"]), want, rtol=2e-3, atol=2e-3)


def test_batch_32_prefill_projection_runs_on_the_card():
    """Llama-3.1-70B's MLP projection at TP 2 for a batch-32 prefill of 512
    tokens, eager, timing only: a device kernel, no host fallback."""
    x = torch.empty(32, 512, 8192, dtype=torch.float16, device="spyre")
    w = torch.empty(14336, 8192, dtype=torch.float16, device="spyre")
    torch_spyre.reset_fallback_counts()
    # "error": a host fallback would compute 3.8 TFLOP on the host, not fail
    with timing_only(), fallback_policy("error"):
        F.linear(x, w)
    assert torch_spyre.fallback_counts() == {}
    (prog,) = [
        k.program for key, k in launch._cache.items() if key[0] == "mm" and key[2] == (32, 512, 8192)
    ]  # fmt: skip
    assert prog is not None and _dims(prog)["x1"][0] > 1
