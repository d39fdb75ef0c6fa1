"""Multi-LoRA on the card: a batch's adapters applied to one projection in one program.

``sgmv_add_(y, x, index, a, b, live)`` adds to ``y`` the deltas where token
``t``'s is ``x[t] @ A_i[e]^T @ B_i[e]^T`` for every slice ``i`` of the
projection (at its columns of ``y``), ``e`` the token's adapter slot, and zero
for base-model tokens.  The batch's grouping comes from the host (the LoRA
mapping is host state): ``index.counts`` (tokens per slot) and, on the card,
the LoRA tokens ordered by slot (``index.rows``, int32 ``[M, 1]`` for the
kernel, int64 ``[M]`` for gathers) and each token's grouped row
(``index.inv``), and each slot's first row when its rows are one run
(``index.starts``).  On spyre it is **one grouped kernel**
(``kernels.lora.sgmv_indexed``): per live (slice, slot with tokens), a shrink
phase reading the slot's token rows of ``x`` (in place when they are one run,
else gathered through the row table), then an expand phase adding into the
same rows of ``y``; the stacked weights are read in place.  Nothing else
runs: no copies, no zero fill.

When the indexed program cannot express the projection (a slice's columns of
``y`` do not start on a stick; ``y`` in another dtype than the weights, as an
fp32 LM head's logits; the embedding's expand-only LoRA), the rows are
grouped by a gather, the grouped kernel ``kernels.lora.sgmv`` runs, and each
token's delta is gathered back and added (four more card programs).

Compiled graphs call it through the op ``spyre::punica_sgmv`` (an opaque
node: a fallback kernel calling this eager kernel, as ``spyre::moe_experts``),
which reads the step's grouping, when it runs, from the ``Source`` set with
``set_source``: vLLM's punica wrapper (``vllm_plugin/lora.py``), or
``spyre estimate --lora`` (``models/lora_estimate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from torch_spyre.ir import ProgramError
from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class RowIndex:
    """A step's rows grouped by adapter slot (see the module docstring)."""

    counts: tuple[int, ...]
    rows: torch.Tensor  # int64 [M]: the LoRA rows in slot order (first sum(counts))
    rows32: torch.Tensor  # int32 [M, 1]: the same, the kernel's row table
    inv: torch.Tensor  # int64 [M]: each row's grouped row, sum(counts) for none
    #: host: each slot's first row when its rows are one run (read in place), else None
    starts: tuple[int | None, ...] = ()


def group_rows(
    slots: np.ndarray, num_slots: int, max_tokens: int
) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """(tokens per slot, the LoRA tokens in slot order, each token's grouped row)
    for the step's token -> slot map (-1: base model).  Both arrays have
    ``max_tokens`` entries; a token without an adapter, and every position past
    the step's tokens (a compiled bucket's padding), has row ``sum(counts)``: the
    op's zero row."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size and slots.max(initial=-1) >= num_slots:
        raise ValueError(f"lora: slot {int(slots.max())} of {num_slots}")
    lora = np.flatnonzero(slots >= 0)
    order = lora[np.argsort(slots[lora], kind="stable")]
    counts = np.bincount(slots[lora], minlength=num_slots)
    r = len(order)
    rows = np.zeros(max_tokens, dtype=np.int64)
    rows[:r] = order
    inv = np.full(max_tokens, r, dtype=np.int64)
    inv[order] = np.arange(r, dtype=np.int64)
    return tuple(int(c) for c in counts), rows, inv


def runs(counts: tuple[int, ...], rows: np.ndarray) -> tuple[int | None, ...]:
    """Each slot's first row when its rows (``rows``, in slot order) are one run."""
    out: list[int | None] = []
    row0 = 0
    for c in counts:
        mine = rows[row0 : row0 + c]
        out.append(int(mine[0]) if c and int(mine[-1]) - int(mine[0]) == c - 1 else None)
        row0 += c
    return tuple(out)


def row_index(slots: np.ndarray, num_slots: int, max_rows: int, device) -> RowIndex:
    """A new ``RowIndex`` for rows' slots (-1: none), its tables on ``device``."""
    counts, rows, inv = group_rows(slots, num_slots, max_rows)
    return RowIndex(
        counts,
        torch.from_numpy(rows).to(device),
        torch.from_numpy(rows.astype(np.int32)).reshape(-1, 1).to(device),
        torch.from_numpy(inv).to(device),
        runs(counts, rows),
    )


def reference(
    y: torch.Tensor,
    x: torch.Tensor,
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
    index: RowIndex,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    live: tuple[tuple[bool, ...], ...] | None = None,
) -> None:
    """``y += `` the LoRA deltas, on the card.  y [T, N], x [T, K], a[i] [L, 1, r, K],
    b[i] [L, 1, n_i, r] (sum n_i = N).  ``a`` empty: expand only, ``x`` [T, r] is
    already shrunk (the embedding's LoRA).  ``live[i][e]``: slot ``e`` holds
    weights for slice ``i`` (None: all do); a dead pair runs nothing."""
    if y.device.type != "spyre":
        raise RuntimeError("lora sgmv runs on spyre tensors")
    counts = index.counts
    check(y, x, a, b, len(counts))
    if live is None:
        live = tuple((True,) * len(counts) for _ in b)
    live = tuple(tuple(bool(v and c) for v, c in zip(sl, counts)) for sl in live)
    if not any(any(sl) for sl in live):
        return  # no token of the step uses an adapter with weights here: nothing runs
    if a and y.dtype == x.dtype and _indexed(y, x, index, a, b, live):
        return
    _grouped(y, x, index, a, b, live)


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


def b_stack(slots: int, n: int, rank: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero B stack [slots, 1, n, rank] for the card, stored transposed: the
    view of an [slots, 1, rank, n] tensor.  In the default layout the last dim
    is the stick dim, so [.., n, rank] would pad each rank-``rank`` row to a
    whole stick (a rank-16 fp16 stack: 4x its bytes, in device memory and in
    every expand's reads); stored [.., rank, n] it is whole sticks of ``n``."""
    return torch.zeros((slots, 1, rank, n), dtype=dtype, device=device).transpose(2, 3)


def stored_b(b: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """The B stacks as the program reads them, and whether they are stored
    transposed (every one a view ``b_stack`` made: the program reads the
    [L, 1, r, n] tensors under them)."""
    if all(operands.is_whole_default(bi.transpose(2, 3)) for bi in b):
        return [bi.transpose(2, 3) for bi in b], True
    return list(b), False


def _kernel(key: tuple, build) -> launch.Kernel:
    """The cached kernel for ``key``; a program the builder rejects is cached as None."""

    def guarded() -> launch.Kernel:
        try:
            return launch.Kernel(build())
        except ProgramError as err:
            return launch.Kernel(None, {"rejected": str(err)})  # type: ignore[arg-type]

    return launch.kernel(key, guarded)


def _indexed(y, x, index: RowIndex, a, b, live) -> bool:
    """The one-program path (gathered rows, in-place accumulate); False when the
    card rejects its program (the caller takes the grouped path)."""
    from torch_spyre.kernels import lora

    counts = index.counts
    r = sum(counts)
    t, k = x.shape
    rank = int(b[0].shape[3])
    slices = tuple(int(bi.shape[2]) for bi in b)
    dev = x.device
    m = index.rows32.shape[0]
    starts = index.starts or (None,) * len(counts)
    b, bt = stored_b(b)
    key = ("lora_sgmv_indexed", counts, starts, k, rank, slices, live, x.dtype, t, m, bt)
    cfg = cards.config(dev.index or 0)
    kern = _kernel(
        key,
        lambda: lora.sgmv_indexed(
            counts,
            k,
            rank,
            slices,
            live,
            x.dtype,
            tokens=t,
            starts=starts,
            table_rows=m,
            bt=bt,
            config=cfg,
        ),  # fmt: skip
    )
    if kern.program is None:
        return False
    buffers = {
        "x": operands.device_memory(operands.whole(x)),
        "y": operands.device_memory(operands.whole(y)),
        "rows": operands.device_memory(operands.whole(index.rows32)),
    }
    for i, (ai, bi) in enumerate(zip(a, b)):
        if not any(live[i]):
            continue
        buffers[f"a{i}"] = operands.device_memory(operands.whole(ai))
        buffers[f"b{i}"] = operands.device_memory(operands.whole(bi))
        buffers[f"s{i}"] = operands.device_memory(torch.empty((r, rank), dtype=x.dtype, device=dev))
    kern.launch_memory(dev.index or 0, buffers)
    dispatch_stats.record("kernel", "lora_sgmv")
    return True


def _grouped(y, x, index: RowIndex, a, b, live) -> None:
    """Rows grouped by a gather, the grouped kernel, deltas gathered back and added."""
    from torch_spyre.kernels import lora

    counts = index.counts
    r = sum(counts)
    t, k = x.shape
    shrink = bool(a)
    rank = int(b[0].shape[3])
    slices = tuple(int(bi.shape[2]) for bi in b)
    dev = x.device
    xg = x.index_select(0, index.rows[:r])
    # one zero row past the grouped rows: base-model and padding tokens gather it
    out = torch.zeros((r + 1, y.shape[1]), dtype=x.dtype, device=dev)
    b, bt = stored_b(b)
    key = ("lora_sgmv", counts, k, rank, slices, live, x.dtype, r + 1, shrink, bt)
    cfg = cards.config(dev.index or 0)
    kern = _kernel(
        key,
        lambda: lora.sgmv(
            counts,
            k,
            rank,
            slices,
            x.dtype,
            out_rows=r + 1,
            live=live,
            shrink=shrink,
            bt=bt,
            config=cfg,
        ),
    )
    if kern.program is None:
        raise RuntimeError(
            f"lora sgmv: no program for {counts} tokens per slot, K={k}, rank {rank}, "
            f"slices {slices}: {kern.info.get('rejected', '')}"
        )
    buffers = {"x": operands.device_memory(xg), "out": operands.device_memory(out)}
    for i, bi in enumerate(b):
        if any(live[i]):
            buffers[f"b{i}"] = operands.device_memory(operands.whole(bi))
    for i, ai in enumerate(a):
        if any(live[i]):
            buffers[f"a{i}"] = operands.device_memory(operands.whole(ai))
            buffers[f"s{i}"] = operands.device_memory(
                torch.empty((r, rank), dtype=x.dtype, device=dev)
            )
    kern.launch_memory(dev.index or 0, buffers)
    dispatch_stats.record("kernel", "lora_sgmv_grouped")
    y.add_(out.index_select(0, index.inv[:t]))


class Source(Protocol):
    """Who holds the step's grouping the op ``spyre::punica_sgmv`` reads."""

    def grouping(self, sampled: bool) -> RowIndex | None:
        """The grouping of the step's tokens (``sampled``: of its sampled rows,
        the LM head's)."""

    def live(self, b0: torch.Tensor) -> tuple[tuple[bool, ...], ...] | None:
        """Which slots hold weights, per slice, of the layer whose first B
        stack is ``b0`` (None: every slot)."""


_source: Source | None = None


def set_source(source: Source | None) -> None:
    """The grouping the op reads from now on (the step's producer sets it)."""
    global _source
    _source = source


@torch.library.custom_op("spyre::punica_sgmv", mutates_args=("y",))
def punica_sgmv(
    y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], sampled: bool
) -> None:
    """``y +=`` the step's LoRA deltas of one projection (slices ``a[i]``/``b[i]``;
    ``a`` empty: ``x`` is already shrunk), the step's grouping of its tokens (or
    of its sampled rows) read from the source when it runs."""
    src = _source
    index = None if src is None else src.grouping(sampled)
    if index is None or not any(index.counts):
        return
    sgmv_add_(y, x, index, a, b, src.live(b[0]))  # type: ignore[union-attr]


@punica_sgmv.register_fake
def _(y, x, a, b, sampled):
    return None
