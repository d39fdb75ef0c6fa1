"""OpInfo samples: generated on the CPU as OpInfo makes them, moved to the device
(tensors, devices and generators), and what cannot run there."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_spyre


class _NotRunnable(Exception):
    """The sample cannot run on spyre for a reason outside the op (dtype, size)."""


def _to_device(tree: Any, device: str, keep: frozenset[int] = frozenset()) -> tuple[Any, bool]:
    """``tree`` with every CPU tensor, device and generator moved to ``device``.

    Views keep their geometry over a moved base (so device views are tested,
    not contiguous copies), and a tensor passed twice stays one tensor, so
    aliasing between arguments is what it was on the CPU.  Tensors whose id
    is in ``keep`` stay where they are.
    """
    memo: dict[int, torch.Tensor] = {}
    moved = False

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        base = t._base
        if (
            base is not None
            and base.dtype == t.dtype
            and base.is_contiguous()
            and base.storage_offset() == 0
            and base.untyped_storage().nbytes() == base.numel() * base.element_size()
        ):
            if id(base) not in memo:
                memo[id(base)] = base.detach().to(device)
            out = memo[id(base)].as_strided(t.shape, t.stride(), t.storage_offset())
        else:
            out = t.detach().to(device)
        memo[id(t)] = out
        return out

    def convert(x: Any) -> Any:
        nonlocal moved
        if isinstance(x, torch.Tensor):
            if id(x) in keep:
                return x
            if (bad := _unsupported_tensor(x)) is not None:
                raise _NotRunnable(f"needs {bad}")
            moved = True
            return move(x)
        if isinstance(x, torch.device) and x.type == "cpu":
            moved = True
            return torch.device(device)
        if isinstance(x, str) and x == "cpu":
            moved = True
            return device
        if isinstance(x, torch.Generator) and x.device.type == "cpu":
            gen = torch.Generator(device=device)
            gen.set_state(x.get_state())
            return gen
        return x

    return tree_map(convert, tree), moved


def _numel(tree: Any) -> int:
    return sum(t.numel() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _unsupported_tensor(t: torch.Tensor) -> str | None:
    """Why spyre cannot hold ``t`` (its dtype or layout), or None."""
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} layout"
    if t.dtype not in torch_spyre.SUPPORTED_DTYPES:
        return str(t.dtype).removeprefix("torch.")
    return None


def _unsupported(tree: Any) -> str | None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and (bad := _unsupported_tensor(t)) is not None:
            return bad
    return None


def describe(tree: Any, limit: int = 160) -> str:
    """A short description of sample arguments: tensors as dtype[shape]."""

    def short(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).removeprefix("torch.")
            extra = "" if x.is_contiguous() else ",strided"
            return _Repr(f"{dt}{list(x.shape)}{extra}")
        return x

    text = repr(tree_map(short, tree))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Repr:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def sample_inputs(op: Any, dtype: torch.dtype) -> Iterator[Any]:
    """``op.sample_inputs("cpu", dtype)``: the same samples with the same values.

    OpInfo's own iterator (``TrackedInputIter``) looks for the unittest test
    that runs it with ``inspect.stack()`` on every sample set and item (~80 ms
    each with this many modules loaded: a third of a whole run), and seeds every
    generator with ``torch.manual_seed``, which queues a call with its formatted
    stack for each uninitialised CUDA-like device.  No test runs here, so it
    would seed every sample with ``SEED``: so do we, for the generators a
    sample reads (CPU, spyre, ``random``, NumPy).  Variants that expose no
    ``sample_inputs_func`` go through ``sample_inputs``.
    """
    func = getattr(op, "sample_inputs_func", None)
    if func is None:
        yield from op.sample_inputs("cpu", dtype)
        return
    from torch.testing._internal import common_utils

    def seed() -> None:
        torch.default_generator.manual_seed(common_utils.SEED)
        torch.spyre.manual_seed_all(common_utils.SEED)
        random.seed(common_utils.SEED)
        if common_utils.TEST_NUMPY:
            import numpy

            numpy.random.seed(common_utils.SEED)

    it = iter(func(op, "cpu", dtype, False))
    while True:
        seed()  # before every item, as OpInfo's iterator
        try:
            sample = next(it)
        except StopIteration:
            return
        yield sample
