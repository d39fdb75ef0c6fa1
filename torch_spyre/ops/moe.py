"""Mixture-of-experts on the card: routing groups, the experts as one grouped program.

``spyre::moe_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)``
is a SwiGLU experts layer as transformers stores it (``gate_up_proj`` [E, 2I, H]
with the gate rows first, ``down_proj`` [E, H, I]): for every token t and
each of its k experts e with weight w, ``out[t] += w * down_e(act(gate_e(x)) * up_e(x))``.
On spyre it runs as

1. **grouping** on the vector units: a one-hot of the S = T*k routed slots
   against the experts, its column sums (tokens per expert), a scan down the
   slots (each slot's rank among its expert's slots) and the exclusive scan of
   the counts (each expert's first row): slot i goes to row
   ``start[e_i] + rank_i`` (a counting sort, O(S*E) comparisons, no sort);
2. the per-expert counts read back to the host (E integers over PCIe,
   modelled): they size the phases of the grouped program, as any
   grouped-GEMM launcher needs them;
3. the slots' activations and routing weights scattered to their rows (DMA);
4. **one grouped kernel** (``kernels.moe.grouped_swiglu``): one phase per expert
   with tokens, the fused SwiGLU program of its rows on all cores, each row
   scaled by its routing weight before the store;
5. the **combine**: each token's k rows gathered back (DMA) and summed.

Compared with transformers' per-expert loop (per expert: a mask, a
``nonzero``, a gather, three matmul kernels, a scatter-add, each a launch and
a host sync), the experts' work is one launch; an expert no token chose costs
nothing, a crowded expert's phase is longer.  Compiled graphs keep the op as
one node (Inductor runs it as a fallback kernel calling this eager kernel).
"""

from __future__ import annotations

import torch

from torch_spyre.ops.registry import kernel
from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: activations the grouped program has a vector op for (transformers ACT2FN names)
ACTIVATIONS = ("silu", "gelu", "relu")


def group_by_expert(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each routed slot when the slots are grouped by expert, tokens per
    expert), both int64 on the ids' device; a counting sort (see above)."""
    dev = flat_ids.device
    experts = torch.arange(num_experts, dtype=torch.int64, device=dev)
    hot = (flat_ids.to(torch.int64).unsqueeze(1) == experts.unsqueeze(0)).to(torch.int64)
    counts = hot.sum(0)
    rank = hot.cumsum(0) - 1  # rank of slot i among its expert's slots, in column e_i
    start = counts.cumsum(0) - counts
    rows = (hot * (rank + start.unsqueeze(0))).sum(1)
    return rows, counts


def _reference(x, idx, w, w13, w2, act):
    """The experts layer written out (any device): transformers' eager loop."""
    fn = _act_fn(act)
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        h = x[tok]
        gu = torch.nn.functional.linear(h, w13[e])
        y = torch.nn.functional.linear(fn(gu[:, :inter]) * gu[:, inter:], w2[e])
        out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
    return out


def _act_fn(act: str):
    f = torch.nn.functional
    return {"silu": f.silu, "gelu": f.gelu, "relu": f.relu}[act]


@torch.library.custom_op("spyre::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """SwiGLU experts: x [T, H], top_k_index/top_k_weights [T, k], gate_up_proj
    [E, 2I, H], down_proj [E, H, I] -> [T, H]."""
    if x.device.type == "spyre":
        out = _device_moe(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
        if out is not None:
            return out
    return _reference(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    return torch.empty_like(x)


def balanced_counts(rows: int, groups: int) -> tuple[int, ...]:
    """``rows`` routed slots spread over ``groups`` experts as evenly as possible."""
    q, r = divmod(rows, groups)
    return tuple(q + (g < r) for g in range(groups))


def _timing_only() -> bool:
    from torch_spyre.sim import timing_only_active

    return timing_only_active()


def _device_moe(x, idx, w, w13, w2, act):
    from torch_spyre.kernels import moe

    if act not in ACTIVATIONS or x.dtype not in _FLOATS or x.dim() != 2 or idx.dim() != 2:
        return None
    if not (x.dtype == w13.dtype == w2.dtype):
        return None
    t, h = x.shape
    num, two_i, h2 = w13.shape
    inter = two_i // 2
    if h2 != h or two_i % 2 or w2.shape != (num, h, inter) or w.shape != idx.shape:
        return None
    k = idx.shape[1]
    dev = x.device
    if t == 0:
        return torch.zeros_like(x)
    rows, counts = group_by_expert(idx.reshape(-1), num)
    # the phases are sized on the host: E integers back over PCIe
    r = t * k
    if _timing_only():
        # the routing was not computed (timing-only runs leave device memory
        # unspecified): plan the balanced routing, deterministic (see estimate.py)
        host_counts = balanced_counts(r, num)
    else:
        host_counts = tuple(int(c) for c in counts.cpu())
    # slot i (token i // k) goes to row rows[i]
    xg = torch.empty((r, h), dtype=x.dtype, device=dev)
    xg.index_copy_(0, rows, x.repeat_interleave(k, dim=0))
    rw = torch.empty((r, 1), dtype=torch.float32, device=dev)
    rw.index_copy_(0, rows, w.reshape(-1, 1).to(torch.float32))
    key = ("moe_swiglu", host_counts, h, inter, x.dtype, act, r)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            moe.grouped_swiglu(host_counts, h, inter, x.dtype, act=act, rows_total=r, config=cfg)
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return None
    yg = torch.empty((r, h), dtype=x.dtype, device=dev)
    w13m = operands.device_memory(operands.whole(w13))
    kern.launch_memory(
        dev.index or 0,
        {
            "x": operands.device_memory(xg),
            "wg": w13m,
            "wu": w13m,
            "wd": operands.device_memory(operands.whole(w2)),
            "rw": operands.device_memory(rw),
            "out": operands.device_memory(yg),
        },
    )
    dispatch_stats.record("kernel", "moe_experts")
    # combine: each token's k rows, summed
    return yg.index_select(0, rows).view(t, k, h).sum(1)


# --------------------------------------------------- torch._grouped_mm
@kernel("_grouped_mm.default")
def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """``out[rows of g] = a[rows of g] @ b[g]`` with groups ending at ``offs``
    (rows past the last group are zero): the grouped matmul program, one
    phase per non-empty group.  Other forms (3-D ``a``, a bias, another output
    dtype) take the host fallback."""
    from torch_spyre.kernels import moe

    if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None:
        return NotImplemented
    if a.dtype not in _FLOATS or b.dtype != a.dtype or out_dtype not in (None, a.dtype):
        return NotImplemented
    num, k, n = b.shape
    if a.shape[1] != k or offs.shape != (num,):
        return NotImplemented
    if _timing_only():
        # offs was not computed (timing-only): the balanced routing (see _device_moe)
        counts = balanced_counts(a.shape[0], num)
        ends = [sum(counts[: g + 1]) for g in range(num)]
    else:
        ends = [int(e) for e in offs.cpu()]  # the group sizes are read on the host
        starts = [0, *ends[:-1]]
        counts = tuple(e - s for s, e in zip(starts, ends))
    if any(c < 0 for c in counts) or (ends and ends[-1] > a.shape[0]):
        raise RuntimeError(
            f"_grouped_mm: offs {ends} must be non-decreasing and at most the {a.shape[0]} rows "
            "of the input"
        )
    out = torch.zeros((a.shape[0], n), dtype=a.dtype, device=a.device)
    if not any(counts) or a.numel() == 0:
        return out
    weight_nk = operands.is_whole_default(b.mT)  # transformers passes W[E, N, K].transpose
    dev = a.device

    def build(chunk: int | None) -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            moe.grouped_matmul(
                counts, k, n, a.dtype, weight_nk=weight_nk, rows_total=a.shape[0], config=cfg,
                n_chunk=chunk,
            )
        )  # fmt: skip

    chunk = None
    while True:
        key = ("grouped_mm", counts, a.shape[0], k, n, a.dtype, weight_nk, chunk)
        kern = launch.kernel(key, lambda c=chunk: build(c))
        reason = str(kern.info.get("rejected", "")) if kern.program is None else ""
        # a core's device-memory span exceeded: blocks of fewer output columns
        cols = chunk or n
        if "span" not in reason or cols <= 64:
            break
        chunk = max(64, (cols // 2 + 63) // 64 * 64)
    if kern.program is None:
        return NotImplemented
    w = b.mT if weight_nk else operands.whole(b)
    kern.launch(
        {"a": operands.whole(a), "b": w, "out": out},
    )
    return out
