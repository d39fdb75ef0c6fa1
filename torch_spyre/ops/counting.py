"""Counting and membership ops (``histc``, ``bincount``, ``isin``) as kernels of the card.

Generation and mixture-of-experts routing call them on small integer
tensors: ``torch.isin(ids, eos_ids)`` every step of ``generate``, and
``torch.histc(expert_ids.int(), bins=num_experts)`` in transformers' MoE
helpers on every device but cpu/mps (the CPU has no integer ``histc``, so
the host fallback cannot even run it).  The card has no histogram unit; each
op is written as a broadcast comparison against the bins (or the test
values) and a reduction, the same one-hot form a vector unit computes:

* ``histc(x, bins, lo, hi)``: bin ``b = floor((x - lo) * bins / (hi - lo))``
  (``x == hi`` falls in the last bin, values outside ``[lo, hi]`` are not
  counted), then ``counts[j] = sum_i (b_i == j)``.  Integer inputs with
  integer bounds use exact integer arithmetic (the floor division adapter);
  others fp32, in the order of PyTorch's CPU kernel.
* ``bincount(x, weights, minlength)``: ``counts[j] = sum_i (x_i == j) * w_i``
  over ``max(x) + 1`` bins (one scalar read back to size the output, as on
  any device).
* ``isin(e, t)``: ``any_j (e_i == t_j)``.

The work is ``n x bins`` (or ``n x len(t)``) comparisons on the vector
units: modelled as such by the kernels the adapter runs.  Long inputs are
cut into pieces of at most ``_CHUNK`` comparisons.
"""

from __future__ import annotations

import torch

from torch_spyre.ops.adapters import adapter

#: comparisons per piece (bounds the one-hot intermediate: 16 Mi bools = 16 MiB)
_CHUNK = 1 << 24

_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _spyre(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "spyre"


def _one_hot_sum(
    values: torch.Tensor, classes: torch.Tensor, weights: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor:
    """``out[j] = sum_i (values_i == classes_j) * w_i``, in pieces of _CHUNK comparisons."""
    n, m = values.numel(), classes.numel()
    out = torch.zeros(m, dtype=acc, device=values.device)
    if n == 0 or m == 0:
        return out
    step = max(1, _CHUNK // m)
    flat = values.reshape(-1)
    wflat = None if weights is None else weights.reshape(-1)
    for i in range(0, n, step):
        hit = flat[i : i + step].unsqueeze(-1) == classes.unsqueeze(0)  # [piece, m]
        if wflat is None:
            part = hit.sum(0, dtype=acc)
        else:
            w = wflat[i : i + step].to(acc).unsqueeze(-1)
            part = torch.where(hit, w, torch.zeros((), dtype=acc, device=w.device)).sum(0)
        out = out + part
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) or (isinstance(v, float) and v.is_integer())


@adapter("histc", reason="no histogram unit: bin index, one-hot comparison with the bins, sum")
def _histc(op, bound):
    from torch_spyre.ops.adapters import _floor_div

    x = bound["self"]
    if not _spyre(x) or x.dtype == torch.bool or x.dtype.is_complex:
        return NotImplemented
    bins = int(bound.get("bins", 100))
    lo, hi = bound.get("min", 0), bound.get("max", 0)
    lo = lo.item() if isinstance(lo, torch.Tensor) else lo
    hi = hi.item() if isinstance(hi, torch.Tensor) else hi
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    if lo == hi and x.numel() > 0:
        # PyTorch's rule: the data's own range (a read of two scalars)
        lo, hi = float(x.min().item()), float(x.max().item())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError(f"torch.histc: max must be larger than min, got min={lo}, max={hi}")
    out_dtype = x.dtype
    if x.dtype in _INTS and _is_int(lo) and _is_int(hi):
        lo_i, hi_i = int(lo), int(hi)
        xi = x.reshape(-1).to(torch.int64)
        valid = (xi >= lo_i) & (xi <= hi_i)
        num = (xi - lo_i) * bins
        den = torch.full((), hi_i - lo_i, dtype=torch.int64, device=x.device)
        b = _floor_div(num, den)
    else:
        xf = x.reshape(-1).float()
        valid = (xf >= lo) & (xf <= hi)
        # PyTorch's CPU kernel: (elt - leftmost) * bins / (rightmost - leftmost), truncated
        b = torch.floor((xf - float(lo)) * float(bins) / (float(hi) - float(lo))).to(torch.int64)
    b = torch.where(b >= bins, torch.full_like(b, bins - 1), b)  # x == hi: the last bin
    b = torch.where(valid, b, torch.full_like(b, -1))  # out of range: no bin
    classes = torch.arange(bins, dtype=torch.int64, device=x.device)
    acc = torch.int64 if out_dtype in _INTS else torch.float32
    return _one_hot_sum(b, classes, None, acc).to(out_dtype)


@adapter("bincount", reason="no histogram unit: one-hot comparison with the bins, (weighted) sum")
def _bincount(op, bound):
    x, weights = bound["self"], bound.get("weights")
    minlength = int(bound.get("minlength", 0))
    if not _spyre(x) or x.dtype not in _INTS or x.dim() != 1:
        return NotImplemented
    if weights is not None and (not _spyre(weights) or weights.shape != x.shape):
        return NotImplemented
    if x.numel() and int(x.min().item()) < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    n = max(minlength, int(x.max().item()) + 1 if x.numel() else 0)
    classes = torch.arange(n, dtype=torch.int64, device=x.device)
    values = x.to(torch.int64)
    if weights is None:
        return _one_hot_sum(values, classes, None, torch.int64)
    # PyTorch returns float64 for float64 weights and float32 otherwise; the card
    # accumulates in fp32 (no fp64 arithmetic)
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    return _one_hot_sum(values, classes, weights, torch.float32).to(acc)


@adapter("isin", reason="membership: broadcast comparison with the test values, any-reduction")
def _isin(op, bound):
    elements = bound.get("elements", bound.get("element"))
    test = bound.get("test_elements", bound.get("test_element"))
    invert = bool(bound.get("invert", False))
    device = next((t.device for t in (elements, test) if _spyre(t)), None)
    if device is None:
        return NotImplemented
    if not isinstance(elements, torch.Tensor):
        elements = torch.tensor(elements, device=device)
    if not isinstance(test, torch.Tensor):
        test = torch.tensor(test, device=device)
    if elements.device != device or test.device != device:
        return NotImplemented
    if elements.dtype.is_complex or test.dtype.is_complex:
        return NotImplemented
    t = test.reshape(-1)
    flat = elements.reshape(-1)
    if flat.numel() == 0 or t.numel() == 0:
        out = torch.zeros(elements.shape, dtype=torch.bool, device=device)
        return ~out if invert else out
    step = max(1, _CHUNK // t.numel())
    parts = [
        (flat[i : i + step].unsqueeze(-1) == t.unsqueeze(0)).any(-1)
        for i in range(0, flat.numel(), step)
    ]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(elements.shape)
    return ~out if invert else out
