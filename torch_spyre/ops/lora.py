"""Multi-LoRA on the card: a batch's adapters applied to one projection in one program.

``sgmv_add_(y, x, rows, inv, a, b, counts)`` adds to ``y`` the deltas where
token ``t``'s ``delta`` is ``x[t] @ A_i[e]^T @ B_i[e]^T`` for every slice ``i``
of the projection (at its columns of ``y``), ``e`` the token's adapter slot,
and zero for base-model tokens.  The batch's grouping comes from the host (the
LoRA mapping is host state): ``counts`` (tokens per slot), ``rows`` (the LoRA
tokens ordered by slot, on the card) and ``inv`` (each token's grouped row, or
``sum(counts)`` for a base-model or padding token, on the card).  On spyre:

1. the LoRA tokens' rows of ``x`` gathered (DMA, ``index_select``);
2. **one grouped kernel** (``kernels.lora.sgmv``): the shrink of every slice
   for every slot with tokens, then the expands, each slot's weights read in
   place from the stacks;
3. each token's delta gathered back from the grouped rows (a zero row for
   base-model tokens) and added to ``y``.

vLLM's punica wrapper calls it through its op ``spyre::punica_sgmv``
(``vllm_plugin/lora.py``), one node of compiled graphs (a fallback kernel
calling this eager kernel, as ``spyre::moe_experts``).
"""

from __future__ import annotations

import torch

from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
    inv: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    slots: torch.Tensor,
) -> torch.Tensor:
    """The op written out per token (any device): ``slots`` [T] each token's slot, -1 none."""
    deltas = []
    for i, bi in enumerate(b):
        d = torch.zeros((x.shape[0], bi.shape[2]), dtype=y.dtype, device=y.device)
        for t, e in enumerate(slots.tolist()):
            if e >= 0:
                s = x[t] @ a[i][e, 0].T if a else x[t]
                d[t] = s @ bi[e, 0].T
        deltas.append(d)
    return y + torch.cat(deltas, dim=1)


def sgmv_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    inv: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    counts: tuple[int, ...],
) -> None:
    """``y += `` the LoRA deltas, on the card.  y [T, N], x [T, K], rows [>= R]
    and inv [>= T] int64 (R = ``sum(counts)``), a[i] [L, 1, r, K], b[i]
    [L, 1, n_i, r] (sum n_i = N), counts [L] (host integers).  ``a`` empty:
    expand only, ``x`` [T, r] is already shrunk (the embedding's LoRA)."""
    if y.device.type != "spyre":
        raise RuntimeError("lora sgmv runs on spyre tensors")
    _device_sgmv(y, x, rows, inv, a, b, tuple(counts))


def check(
    y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], num: int
) -> None:
    """Refuse operands the grouped program does not describe (the message names them)."""
    problems = []
    if y.dim() != 2 or x.dim() != 2 or y.shape[0] != x.shape[0]:
        problems.append(f"y {tuple(y.shape)} and x {tuple(x.shape)} must be [T, N] and [T, K]")
    if x.dtype not in _FLOATS or y.dtype not in _FLOATS:
        problems.append(f"x {x.dtype}, y {y.dtype}: float tensors")
    if any(t.dtype != x.dtype for t in (*a, *b)):
        problems.append("x and the stacks must share one dtype")
    if (a and len(a) != len(b)) or not b:
        problems.append(f"{len(a)} A stacks and {len(b)} B stacks")
    for i, bi in enumerate(b):
        ai = a[i] if a else None
        if bi.dim() != 4 or bi.shape[0] != num:
            problems.append(f"B stack {tuple(bi.shape)} for {num} slots")
        elif ai is None:
            if bi.shape[3] != x.shape[1]:
                problems.append(f"B {tuple(bi.shape)} against shrunk x {tuple(x.shape)}")
        elif ai.dim() != 4 or ai.shape[0] != num:
            problems.append(f"A stack {tuple(ai.shape)} for {num} slots")
        elif ai.shape[3] != x.shape[1] or ai.shape[2] != bi.shape[3]:
            problems.append(f"A {tuple(ai.shape)} / B {tuple(bi.shape)} against x {tuple(x.shape)}")
    if not problems and sum(bi.shape[2] for bi in b) != y.shape[1]:
        problems.append(f"B stacks' outputs {[bi.shape[2] for bi in b]} against y {y.shape[1]}")
    if problems:
        raise RuntimeError("lora sgmv: " + "; ".join(problems))


def _device_sgmv(y, x, rows, inv, a, b, counts: tuple[int, ...]) -> None:
    from torch_spyre.kernels import lora

    check(y, x, a, b, len(counts))
    r = sum(counts)
    if r == 0:
        return  # no token of the step uses an adapter: nothing runs
    t, k = x.shape
    shrink = bool(a)
    rank = int(b[0].shape[3])
    slices = tuple(int(bi.shape[2]) for bi in b)
    dev = x.device
    xg = x.index_select(0, rows[:r])
    # one zero row past the grouped rows: base-model and padding tokens gather it
    out = torch.zeros((r + 1, y.shape[1]), dtype=x.dtype, device=dev)
    scratch = [torch.empty((r, rank), dtype=x.dtype, device=dev) for _ in a]
    key = ("lora_sgmv", counts, k, rank, slices, x.dtype, r + 1, shrink)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            lora.sgmv(counts, k, rank, slices, x.dtype, out_rows=r + 1, shrink=shrink, config=cfg)
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        raise RuntimeError(
            f"lora sgmv: no program for {counts} tokens per slot, K={k}, rank {rank}, "
            f"slices {slices}: {kern.info.get('rejected', '')}"
        )
    buffers = {"x": operands.device_memory(xg), "out": operands.device_memory(out)}
    for i, bi in enumerate(b):
        buffers[f"b{i}"] = operands.device_memory(operands.whole(bi))
    for i, (ai, si) in enumerate(zip(a, scratch)):
        buffers[f"a{i}"] = operands.device_memory(operands.whole(ai))
        buffers[f"s{i}"] = operands.device_memory(si)
    kern.launch_memory(dev.index or 0, buffers)
    dispatch_stats.record("kernel", "lora_sgmv")
    y.add_(out.index_select(0, inv[:t]))
