"""The one explicit host fallback for aten ops that have no spyre kernel.

The op runs on the host: spyre inputs are copied to the CPU (modelled as
device->host transfers), the CPU kernel runs, mutated inputs and new outputs
are copied back (host->device).  Each use is counted per op, warned about
once per op, and governed by a policy:

* ``warn`` (default): run it and warn the first time an op falls back;
* ``silent``: run it quietly (still counted);
* ``error``: raise, naming the op and the shapes.

Set it with ``torch_spyre.set_fallback_policy`` or ``TORCH_SPYRE_FALLBACK``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._pytree import tree_flatten, tree_map

from torch_spyre import settings
from torch_spyre.runtime import access, cards, dispatch_stats, scalars

_POLICIES = ("warn", "silent", "error")
_warned: set[str] = set()


class SpyreFallbackWarning(UserWarning):
    """An aten op ran on the host because spyre has no kernel for it."""


class SpyreFallbackError(NotImplementedError):
    """An aten op has no spyre kernel and the fallback policy is ``error``."""


def set_fallback_policy(policy: str) -> None:
    if policy not in _POLICIES:
        raise ValueError(f"fallback policy must be one of {_POLICIES}, got {policy!r}")
    settings.update(fallback=policy)


def get_fallback_policy() -> str:
    return settings.get().fallback


@contextmanager
def fallback_policy(policy: str):
    old = get_fallback_policy()
    set_fallback_policy(policy)
    try:
        yield
    finally:
        set_fallback_policy(old)


def fallback_counts() -> dict[str, int]:
    """How many times each op ran through the host fallback."""
    return dispatch_stats.counts("fallback")


def reset_fallback_counts() -> None:
    dispatch_stats.reset("fallback")
    _warned.clear()


def _shown_always() -> bool:
    """Whether an ``always`` filter naming this category is in force
    (``warnings.simplefilter("always", FallbackWarning)``, as IBM's tests do):
    then every fallback warns, not only an op's first.  A filter for all
    warnings keeps the once-per-op rule."""
    for action, message, category, module, _lineno in warnings.filters:
        if message is None and module is None and issubclass(SpyreFallbackWarning, category):
            return action == "always" and issubclass(category, SpyreFallbackWarning)
    return False


def _describe(args, kwargs) -> str:
    shapes = []
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, torch.Tensor):
            shapes.append(f"{a.dtype}{list(a.shape)}@{a.device}")
    return ", ".join(shapes) or "no tensors"


def _first_spyre_device(flat) -> torch.device:
    for a in flat:
        if isinstance(a, torch.Tensor) and a.device.type == "spyre":
            return a.device
        if isinstance(a, torch.device) and a.type == "spyre":
            return torch.device("spyre", a.index if a.index is not None else _current())
    return torch.device("spyre", _current())


def _current() -> int:
    from torch_spyre import _C

    return _C._get_device()


def _is_view_op(op) -> bool:
    returns = op._schema.returns
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _run_view_op(op, args, kwargs):
    """View ops only compute geometry: do it on meta tensors, then alias."""
    spyre_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]

    def to_meta(a):
        if isinstance(a, torch.Tensor) and a.device.type == "spyre":
            base = torch.empty(
                a.untyped_storage().nbytes() // a.element_size(), dtype=a.dtype, device="meta"
            )
            return base.as_strided(a.shape, a.stride(), a.storage_offset())
        return a

    out = op(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    source = spyre_in[0]

    def alias(o):
        if isinstance(o, torch.Tensor):
            if o.dtype != source.dtype:
                return source.view(o.dtype).as_strided(o.shape, o.stride(), o.storage_offset())
            return source.as_strided(o.shape, o.stride(), o.storage_offset())
        return o

    return tree_map(alias, out)


@contextmanager
def _device_rng(device: torch.device):
    """Run CPU kernels with the spyre generator's state as the CPU default."""
    gen = torch.spyre.default_generators[device.index]
    cpu_default = torch.default_generator
    saved = cpu_default.get_state()
    cpu_default.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(cpu_default.get_state())
        cpu_default.set_state(saved)


def _cpu_twin(gen):
    if isinstance(gen, torch.Generator) and gen.device.type == "spyre":
        twin = torch.Generator()
        twin.set_state(gen.get_state())
        return twin
    return gen


def host_fallback(op, *args, **kwargs):
    name = str(op).removeprefix("aten.")
    if _is_view_op(op):
        return _run_view_op(op, args, kwargs)
    policy = settings.get().fallback
    if policy == "error":
        raise SpyreFallbackError(
            f"spyre has no kernel for aten.{name} ({_describe(args, kwargs)}) and the "
            f"fallback policy is 'error'. Use torch_spyre.set_fallback_policy('warn') "
            f"(or TORCH_SPYRE_FALLBACK=warn) to run it on the host, or move the "
            f"tensors to the CPU for this op."
        )
    dispatch_stats.record("fallback", name)
    if policy == "warn" and (name not in _warned or _shown_always()):
        _warned.add(name)
        warnings.warn(
            f"spyre: aten.{name} has no device kernel for these inputs; it runs on the host "
            f"with copies "
            f"to and from the card (counted in torch_spyre.fallback_counts()).",
            SpyreFallbackWarning,
            stacklevel=3,
        )
    return run_on_values(op, args, kwargs, pcie=True)


#: ops that write arguments their schema does not mark as written
_UNDECLARED_WRITES = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
}


def run_on_values(op, args, kwargs, pcie: bool):
    """Run ``op`` with torch's CPU kernel on the *values* of its spyre arguments.

    Mutated arguments and new outputs are written back to the card.  With
    ``pcie`` every copy is modelled as a transfer to or from the host (the host
    fallback); without it the caller models the work as a device kernel.
    """
    args, kwargs = scalars.rewrap(op, args, kwargs)
    flat = tree_flatten((args, kwargs))[0]
    device = _first_spyre_device(flat)
    schema = op._schema
    label = f"fallback {op}"
    originals: dict[int, torch.Tensor] = {}
    copied: dict[int, torch.Tensor] = {}  # one host copy per device tensor

    def to_cpu(a):
        if isinstance(a, torch.Tensor) and a.device.type == "spyre":
            if id(a) in copied:
                return copied[id(a)]
            cpu = access.read(a)
            if pcie:
                cards.record_transfer(a.device.index, "d2h", access.device_nbytes(a), label)
            originals[id(cpu)] = a
            copied[id(a)] = cpu
            return cpu
        if isinstance(a, torch.device) and a.type == "spyre":
            return torch.device("cpu")
        if isinstance(a, torch.Generator):
            return _cpu_twin(a)
        return a

    cpu_args = tree_map(to_cpu, args)
    cpu_kwargs = tree_map(to_cpu, kwargs)
    _check_on_host(op, cpu_args, cpu_kwargs)
    run = host_kernel(op)
    seeded = torch.Tag.nondeterministic_seeded in op.tags
    if seeded:
        with _device_rng(device):
            out = run(*cpu_args, **cpu_kwargs)
    else:
        out = run(*cpu_args, **cpu_kwargs)
    _sync_generators(args, kwargs, cpu_args, cpu_kwargs)

    # write back every argument the op mutates
    written: dict[int, torch.Tensor] = {}
    undeclared = _UNDECLARED_WRITES.get(schema.name, ())
    for i, arg in enumerate(schema.arguments):
        declared = arg.alias_info is not None and arg.alias_info.is_write
        if not declared and arg.name not in undeclared:
            continue
        cpu = cpu_kwargs.get(arg.name) if arg.kwarg_only else None
        if cpu is None and i < len(cpu_args):
            cpu = cpu_args[i]
        if cpu is None:
            cpu = cpu_kwargs.get(arg.name)
        for c in tree_flatten(cpu)[0]:
            if isinstance(c, torch.Tensor) and id(c) in originals:
                dst = originals[id(c)]
                if dst.shape != c.shape:
                    dst.resize_(c.shape)
                access.write(dst, c)
                if pcie:
                    cards.record_transfer(dst.device.index, "h2d", access.device_nbytes(dst), label)
                written[id(c)] = dst

    def to_spyre(o):
        if isinstance(o, torch.Tensor) and (o.is_nested or o.layout != torch.strided):
            raise NotImplementedError(
                f"aten.{str(op).removeprefix('aten.')} ran on the host and returned a "
                f"{'nested' if o.is_nested else str(o.layout)} tensor, which the card does not "
                f"hold (it stores strided tensors only): run this step on the CPU"
            )
        if isinstance(o, torch.Tensor):
            if id(o) in written:
                return written[id(o)]
            if id(o) in originals:  # returned an input unchanged
                return originals[id(o)]
            # the CPU kernel's strides are the ones its meta kernel promised
            # (a triangular solve returns column-major results): a compiled
            # graph asserts them
            if is_non_overlapping_and_dense_or_false(o):
                res = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device)
            else:
                res = torch.empty(o.shape, dtype=o.dtype, device=device)
            access.write(res, o)
            if pcie:
                cards.record_transfer(device.index, "h2d", access.device_nbytes(res), label)
            return res
        return o

    return tree_map(to_spyre, out)


def _check_on_host(op, cpu_args, cpu_kwargs) -> None:
    """No device tensor may reach a CPU kernel (nested lists, tensor lists,
    optional tensors included: ``tree_map`` walks them all)."""
    for a in tree_flatten((cpu_args, cpu_kwargs))[0]:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            raise RuntimeError(
                f"spyre host fallback of {op}: an argument on {a.device} was not copied "
                f"to the host ({a.dtype}{list(a.shape)})"
            )


def host_kernel(op):
    """What runs ``op`` on the host: its CPU kernel (a composite one included),
    else its decomposition from ``torch._decomp``, else a host twin of an op
    PyTorch only implements for CUDA (``HOST_TWINS``).  An op with none of
    these raises, naming the op: a CPU kernel that does not exist is never
    called."""
    run = _host_kernels.get(op)
    if run is None:
        name = op.name()
        if torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU"):
            run = op
        elif name in HOST_TWINS:
            run = HOST_TWINS[name]
        else:
            from torch._decomp import decomposition_table

            run = decomposition_table.get(op)
        if run is None:
            raise NotImplementedError(
                f"spyre has no kernel for aten.{str(op).removeprefix('aten.')} and PyTorch "
                f"has no CPU kernel or decomposition for it to run on the host: move the "
                f"tensors to the CPU and call the op's CPU counterpart"
            )
        _host_kernels[op] = run
    return run


_host_kernels: dict = {}


def _fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_lstm_cell`` (CUDA only in PyTorch): the gates i, f, g, o
    of ``LSTMCell`` from the two projections; returns (hy, cy, workspace)."""
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """``aten::_thnn_fused_gru_cell`` (CUDA only in PyTorch): r, z, n of ``GRUCell``;
    returns (hy, workspace [r, z, n, hidden n, hx])."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hn, hx], 1)


def _fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """``aten::_thnn_fused_lstm_cell_backward_impl`` (CUDA only): the gradient of
    the gate pre-activations (and of cx, and of the bias) from the workspace
    [i, f, g, o] of the forward."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    gh = grad_hy if grad_hy is not None else torch.zeros_like(cy)
    gc = gh * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        gc = gc + grad_cy
    grad_gates = torch.cat(
        [
            gc * g * i * (1 - i),
            gc * cx * f * (1 - f),
            gc * i * (1 - g * g),
            gh * tanh_cy * o * (1 - o),
        ],
        1,
    )
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, gc * f, grad_bias


def _fused_gru_cell_backward(grad_hy, workspace, has_bias):
    """``aten::_thnn_fused_gru_cell_backward`` (CUDA only): gradients of the input
    and hidden gates, of hx and of the biases from the workspace
    [r, z, n, hidden n, hx]."""
    r, z, n, hn, hx = workspace.chunk(5, 1)
    dn = grad_hy * (1 - z) * (1 - n * n)
    dz = grad_hy * (hx - n) * z * (1 - z)
    dr = dn * hn * r * (1 - r)
    grad_input = torch.cat([dr, dz, dn], 1)
    grad_hidden = torch.cat([dr, dz, dn * r], 1)
    bias = (grad_input.sum(0), grad_hidden.sum(0)) if has_bias else (None, None)
    return grad_input, grad_hidden, grad_hy * z, *bias


#: host implementations of ops PyTorch has only for CUDA, which the composite
#: forms of ops dispatch to for every device but the CPU (``lstm_cell`` and
#: ``gru_cell`` on a PrivateUse1 device call the fused cells)
HOST_TWINS = {
    "aten::_thnn_fused_lstm_cell": _fused_lstm_cell,
    "aten::_thnn_fused_gru_cell": _fused_gru_cell,
    # their backwards (the autograd formulas of the fused cells call them)
    "aten::_thnn_fused_lstm_cell_backward_impl": _fused_lstm_cell_backward,
    "aten::_thnn_fused_gru_cell_backward": _fused_gru_cell_backward,
}


def _sync_generators(args, kwargs, cpu_args, cpu_kwargs) -> None:
    for orig, cpu in zip(tree_flatten((args, kwargs))[0], tree_flatten((cpu_args, cpu_kwargs))[0]):
        if isinstance(orig, torch.Generator) and orig is not cpu:
            orig.set_state(cpu.get_state())
