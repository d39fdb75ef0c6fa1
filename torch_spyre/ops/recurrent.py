"""RNN, LSTM and GRU layers and cells on the card (``kernels/recurrent.py``).

The aten ops ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` and their cells call are
served here: ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (``.input``: a
padded tensor, ``.data``: a ``PackedSequence``) and ``lstm_cell``,
``gru_cell``, ``rnn_tanh_cell``, ``rnn_relu_cell``.  Their composite forms
would call the CUDA-only fused cells on this device, one small op at a time.

Each layer and direction runs as:

1. the input projection of every timestep, one matmul program (both biases
   folded in, except GRU's hidden bias of the new gate);
2. one fused program per timestep: the recurrent matmul of every gate, the
   nonlinearities, the state update (and ``proj_size``'s projection).

A packed sequence is gathered into a padded time-major tensor (a DMA gather)
and each step gets a row mask: a finished sequence keeps its state, so the
last states are each sequence's own, in both directions.  Bidirectional
layers concatenate the two directions (a DMA copy).  Dropout between layers
in training mode is not served (the host fallback runs it, counted).

Under ``torch.compile`` Dynamo does not trace RNN modules
(``torch._dynamo.config.allow_rnn`` is off): the layer runs as these eager
programs between the compiled graphs (with ``allow_rnn`` the compiler gets
the decomposed recurrence instead).
"""

from __future__ import annotations

import torch

from torch_spyre.kernels import recurrent as rk
from torch_spyre.ops.registry import kernel
from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _servable(*tensors) -> bool:
    ts = [t for t in tensors if t is not None]
    return all(
        t.device.type == "spyre" and t.dtype == ts[0].dtype and t.dtype in _FLOATS for t in ts
    )


def _cfg(dev: torch.device):
    return cards.config(dev.index or 0)


def _biases(mode: str, b_ih, b_hh, g: int, h: int, dev, dtype):
    """(bias [G, H] folded into the input projection or None, GRU's b_hn [H])."""
    if b_ih is None:
        bhn = torch.zeros(h, dtype=dtype, device=dev) if mode == "gru" else None
        return None, bhn
    if mode == "gru":
        rz = b_ih[: 2 * h] + b_hh[: 2 * h]
        bias = torch.cat([rz, b_ih[2 * h :]]).view(g, h)
        return bias, b_hh[2 * h :].contiguous()
    return (b_ih + b_hh).view(g, h), None


def _projection(x, w_ih, bias, g, h, batch_first):
    """xp [T, G, B, H] = x @ w_ih^T + bias, one program."""
    b, t = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
    i = x.shape[2]
    dev = x.device
    key = ("rnn_input_proj", t, b, i, g, h, x.dtype, bias is not None, batch_first)

    def build() -> launch.Kernel:
        return launch.Kernel(
            rk.best_input_projection(
                t, b, i, g, h, x.dtype, bias=bias is not None, batch_first=batch_first,
                config=_cfg(dev),
            )
        )  # fmt: skip

    kern = launch.kernel(key, build)
    xp = torch.empty((t, g, b, h), dtype=x.dtype, device=dev)
    ops = {"x": operands.whole(x), "w": operands.whole(w_ih), "out": xp}
    if bias is not None:
        ops["bias"] = operands.whole(bias)
    kern.launch(ops)
    dispatch_stats.record("kernel", "rnn_input_projection")
    return xp


def _direction(mode, x, batch_first, weights, h0, c0, reverse, mask):
    """One layer direction: (outputs [T, B, K] view, h_T [B, K], c_T [B, H] or None)."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    g = rk.GATES[mode]
    h = w_hh.shape[0] // g
    k = w_hh.shape[1]
    b, t = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
    dev, dtype = x.device, x.dtype
    bias, bhn = _biases(mode, b_ih, b_hh, g, h, dev, dtype)
    xp = _projection(x, w_ih, bias, g, h, batch_first)
    hs = torch.empty((t + 1, b, k), dtype=dtype, device=dev)
    hs[t if reverse else 0].copy_(h0)
    proj, masked = w_hr is not None, mask is not None
    cfg = _cfg(dev)
    split, tile_n = rk.best_step_plan(mode, b, h, k, dtype, proj=proj, masked=masked, config=cfg)
    mem = operands.device_memory
    bufs = {"xp": mem(xp), "hs": mem(hs), "w": mem(operands.whole(w_hh))}
    c = None
    if mode == "lstm":
        c = torch.empty((b, h), dtype=dtype, device=dev)
        c.copy_(c0)
        bufs["c"] = mem(c)
    if mode == "gru":
        bufs["bhn"] = mem(operands.whole(bhn))
    if proj:
        bufs["wr"] = mem(operands.whole(w_hr))
    if masked:
        bufs["mask"] = mem(mask)
    for s in range(t - 1, -1, -1) if reverse else range(t):
        key = ("rnn_step", mode, b, h, k, t, s, dtype, reverse, proj, masked)

        def build(s=s) -> launch.Kernel:
            return launch.Kernel(
                rk.recurrent_step(
                    mode, b, h, k, t, s, dtype, reverse=reverse, proj=proj, masked=masked,
                    split=split, tile_n=tile_n, config=cfg,
                )
            )  # fmt: skip

        launch.kernel(key, build).launch_memory(dev.index or 0, bufs)
        dispatch_stats.record("kernel", f"{mode}_step")
    out = hs[:t] if reverse else hs[1:]
    return out, hs[0] if reverse else hs[t], c


def _split_params(params, has_biases: bool, layers: int, dirs: int):
    """Per (layer, direction): (w_ih, w_hh, b_ih, b_hh, w_hr or None)."""
    n = len(params) // (layers * dirs)
    out = []
    for i in range(layers * dirs):
        p = list(params[i * n : (i + 1) * n])
        w_ih, w_hh = p[0], p[1]
        b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
        w_hr = p[n - 1] if n in (3, 5) else None
        out.append((w_ih, w_hh, b_ih, b_hh, w_hr))
    return out


def _layers(mode, x, hx, cx, params, has_biases, layers, dropout, train, bidir, batch_first, mask):
    """The stack: (output [T, B, D*K] time-major, h_n, c_n or None); NotImplemented
    for what the programs do not serve."""
    dirs = 2 if bidir else 1
    if train and dropout > 0 and layers > 1:
        return NotImplemented
    if len(params) % (layers * dirs) or not _servable(x, hx, cx, *params):
        return NotImplemented
    weights = _split_params(params, has_biases, layers, dirs)
    hn, cn = [], []
    inp = x
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            c0 = cx[i] if cx is not None else None
            y, h_last, c_last = _direction(
                mode, inp, batch_first and layer == 0, weights[i], hx[i], c0, d == 1, mask
            )
            outs.append(y)
            hn.append(h_last)
            cn.append(c_last)
        inp = torch.cat(outs, -1) if dirs == 2 else outs[0]
    h_n = torch.stack(hn)
    c_n = torch.stack(cn) if cx is not None else None
    return inp, h_n, c_n


def _batch_first_out(y, batch_first: bool):
    return y.transpose(0, 1).contiguous() if batch_first else y


# --------------------------------------------------------------- padded input
def _padded(mode):
    def run(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if input.dim() != 3:
            return NotImplemented
        h0, c0 = (hx[0], hx[1]) if mode == "lstm" else (hx, None)
        res = _layers(
            mode, input, h0, c0, params, has_biases, num_layers, dropout, train,
            bidirectional, batch_first, None,
        )  # fmt: skip
        if res is NotImplemented:
            return res
        y, h_n, c_n = res
        y = _batch_first_out(y, batch_first)
        return (y, h_n, c_n) if mode == "lstm" else (y, h_n)

    return run


# --------------------------------------------------------------- packed input
def _packing(batch_sizes: torch.Tensor, dev, dtype):
    """(gather index packed -> padded [T*B], its inverse, mask [T, B, 1]) on the card."""
    bs = [int(v) for v in batch_sizes.tolist()]
    t, b = len(bs), bs[0]
    gather, inverse, mask = [], [], torch.zeros(t, b, 1)
    off = 0
    for s, n in enumerate(bs):
        gather += [off + j if j < n else 0 for j in range(b)]
        inverse += [s * b + j for j in range(n)]
        mask[s, :n] = 1
        off += n
    to = lambda v: torch.tensor(v, dtype=torch.int64).to(dev)  # noqa: E731
    return to(gather), to(inverse), mask.to(dtype).to(dev), t, b


def _packed(mode):
    def run(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        if data.dim() != 2 or batch_sizes.device.type != "cpu":
            return NotImplemented
        h0, c0 = (hx[0], hx[1]) if mode == "lstm" else (hx, None)
        if not _servable(data, h0, c0, *params):
            return NotImplemented
        gather, inverse, mask, t, b = _packing(batch_sizes, data.device, data.dtype)
        x = data.index_select(0, gather).view(t, b, data.shape[1])
        res = _layers(
            mode, x, h0, c0, params, has_biases, num_layers, dropout, train, bidirectional,
            False, mask,
        )  # fmt: skip
        if res is NotImplemented:
            return res
        y, h_n, c_n = res
        y = y.reshape(t * b, y.shape[-1]).index_select(0, inverse)
        return (y, h_n, c_n) if mode == "lstm" else (y, h_n)

    return run


# ---------------------------------------------------------------------- cells
def _cell(mode):
    def run(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        if input.dim() != 2:
            return NotImplemented
        h0, c0 = (hx[0], hx[1]) if mode == "lstm" else (hx, None)
        if not _servable(input, h0, c0, w_ih, w_hh, b_ih, b_hh) or (b_ih is None) != (b_hh is None):
            return NotImplemented
        y, h_last, c_last = _direction(
            mode, input.unsqueeze(0), False, (w_ih, w_hh, b_ih, b_hh, None), h0, c0, False, None
        )
        return (h_last, c_last) if mode == "lstm" else h_last

    return run


_OVERLOADS = [
    name
    for mode in ("lstm", "gru", "rnn_tanh", "rnn_relu")
    for name in (f"{mode}.input", f"{mode}.data", f"{mode}_cell")
]
for _name in _OVERLOADS:
    _mode, _, _kind = _name.partition(".")
    kernel(_name)(
        _cell(_mode.removesuffix("_cell")) if not _kind else _padded(_mode) if _kind == "input"
        else _packed(_mode)
    )  # fmt: skip

_libs: list[torch.library.Library] = []


def _autograd(op):
    """The autograd kernel: with a gradient to compute, the composite form (its
    small ops on the card, the fused cells through the host, each counted);
    without, the programs above."""

    def run(*args, **kwargs):
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]
        ):
            return op.decompose(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return run


def register() -> None:
    """Autograd kernels for the overloads served here: a kernel for PrivateUse1
    alone would leave their autograd key without the composite, and a backward
    through them would silently give no gradient."""
    if _libs:
        return
    from torch_spyre.runtime.registration import entry

    lib = torch.library.Library("aten", "IMPL")
    for name in _OVERLOADS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        lib.impl(name, entry(_autograd(op)), "AutogradPrivateUse1")
    _libs.append(lib)
