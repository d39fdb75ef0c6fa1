"""Mamba-2 state-space layers on the card: the chunked scan, the decode step, the gated norm.

* ``spyre::ssd_chunk_scan`` — transformers' ``mamba2_chunk_scan`` (prefill):
  the discretisation (``softplus(dt + dt_bias)`` clamped, ``x * dt``,
  ``A * dt`` and its within-chunk cumulative sum) as eager kernels, the
  padding to whole chunks as DMA, then the three-phase grouped kernel
  ``kernels.ssd.ssd_chunk_scan`` (chunk states, state passing chunk after chunk,
  chunk outputs).  Returns ``(y fp32 [b, s, h, p], final state fp32)``.
* ``spyre::ssm_step`` — ``mamba2_selective_state_update`` (decode): one
  program updating the state in place and producing the output.
* ``spyre::rmsnorm_gated`` — ``w * rmsnorm(x * silu(z))``: one row program.

Off the card each op runs a plain PyTorch reference (the recurrence written
out), which the tests also use to check the chunked form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_spyre.runtime import cards, dispatch_stats, launch, operands

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_masks: dict[tuple[int, int], torch.Tensor] = {}


def _causal_mask(chunk: int, device: torch.device) -> torch.Tensor:
    """1 where s <= l, fp32 [L, L], made once per card (a constant table)."""
    key = (chunk, device.index or 0)
    m = _masks.get(key)
    if m is None:
        m = _masks[key] = torch.tril(torch.ones(chunk, chunk)).to(device)
    return m


def _discretise(dt, dt_bias, dt_min, dt_max):
    dt = F.softplus(dt.float() + dt_bias.float())
    if dt_min > 0.0 or dt_max != float("inf"):
        dt = dt.clamp(dt_min, dt_max)
    return dt


def scan_reference(x, dt, A, B, C, D, init):
    """The recurrence position by position (fp32): ``h_t = exp(dt_t A) h_{t-1} +
    dt_t x_t B_t``, ``y_t = h_t . C_t + D x_t``; dt already discretised."""
    b, s, h, p = x.shape
    g = B.shape[2]
    Bh = B.float().repeat_interleave(h // g, dim=2)
    Ch = C.float().repeat_interleave(h // g, dim=2)
    state = (
        init.float().clone()
        if init is not None
        else x.new_zeros((b, h, p, B.shape[-1]), dtype=torch.float32)
    )
    ys = []
    for t in range(s):
        da = torch.exp(dt[:, t] * A.float())  # [b, h]
        state = (
            state * da[..., None, None]
            + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        )
        y = (state * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D.float()[:, None] * x[:, t].float()
        ys.append(y)
    return torch.stack(ys, 1), state


@torch.library.custom_op("spyre::ssd_chunk_scan", mutates_args=())
def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_states: torch.Tensor | None,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, s, h, p], dt [b, s, h], A/D/dt_bias [h], B/C [b, s, g, n] ->
    (y fp32 [b, s, h, p], final state fp32 [b, h, p, n])."""
    if x.device.type == "spyre":
        out = _device_chunk_scan(
            x, dt, A, B, C, D, dt_bias, initial_states, chunk_size, dt_min, dt_max
        )
        if out is not None:
            return out
    dtd = _discretise(dt, dt_bias, dt_min, dt_max)
    return scan_reference(x, dtd, A, B, C, D, initial_states)


@ssd_chunk_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, initial_states, chunk_size, dt_min, dt_max):
    b, s, h, p = x.shape
    return (
        x.new_empty((b, s, h, p), dtype=torch.float32),
        x.new_empty((b, h, p, B.shape[-1]), dtype=torch.float32),
    )


def _device_chunk_scan(x, dt, A, B, C, D, dt_bias, init, chunk, dt_min, dt_max):
    from torch_spyre.kernels import ssd

    if x.dim() != 4 or x.dtype not in _FLOATS or B.dim() != 4 or C.shape != B.shape:
        return None
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g or dt.shape != (b, s, h) or chunk < 1:
        return None
    dev = x.device
    hg = h // g
    pad = (chunk - s % chunk) % chunk
    c = (s + pad) // chunk
    dtd = _discretise(dt, dt_bias, dt_min, dt_max)  # [b, s, h] fp32
    xd = x.float() * dtd.unsqueeze(-1)
    dA = dtd * A.float()

    def padded(t):  # along the positions (dim 1), to whole chunks
        return F.pad(t, [0, 0] * (t.dim() - 2) + [0, pad]) if pad else t

    xd, xp, dA = padded(xd), padded(x), padded(dA)
    acum = dA.reshape(b, c, chunk, g, hg).cumsum(2)
    init_t = (
        torch.zeros((b, h, p, n), dtype=torch.float32, device=dev) if init is None else init.float()
    )
    key = ("ssd_chunk_scan", b, c, chunk, g, hg, p, n, x.dtype)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(ssd.ssd_chunk_scan(b, c, chunk, g, hg, p, n, x.dtype, config=cfg))

    kern = launch.kernel(key, build)
    if kern.program is None:
        return None
    f32 = torch.float32
    states = torch.empty((b, c, g, hg, p, n), dtype=f32, device=dev)
    cdec = torch.empty((b, c, g, hg, 1), dtype=f32, device=dev)
    enter = torch.empty((b, c + 1, g, hg, p, n), dtype=f32, device=dev)
    y = torch.empty((b, c * chunk, h, p), dtype=f32, device=dev)
    mem, whole = operands.device_memory, operands.whole
    kern.launch_memory(
        dev.index or 0,
        {
            # a [b, c*L, h, p] tensor holds the bytes of its [b, c, L, g, hg, p] view
            # (only dims that are not the stick dim are split)
            "xd": mem(whole(xd)),
            "x": mem(whole(xp)),
            "acum": mem(whole(acum)),
            "B": mem(whole(padded(B.float()))),
            "C": mem(whole(padded(C.float()))),
            "D": mem(whole(D.float().reshape(g, hg))),
            "init": mem(whole(init_t)),
            "mask": mem(_causal_mask(chunk, dev)),
            "states": mem(states),
            "cdec": mem(cdec),
            "enter": mem(enter),
            "y": mem(y),
        },
    )
    dispatch_stats.record("kernel", "ssd_chunk_scan")
    final = enter[:, c].reshape(b, h, p, n)
    return (y[:, :s].contiguous() if pad else y), final.contiguous()


@torch.library.custom_op("spyre::ssm_step", mutates_args=("state",))
def ssm_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:
    """One decode step, in place on ``state`` [b, h, p, n]: x [b, h, p], dt [b, h]
    (before softplus), A/D/dt_bias [h], B/C [b, g, n] -> y [b, h, p]."""
    if x.device.type == "spyre":
        out = _device_step(state, x, dt, A, B, C, D, dt_bias)
        if out is not None:
            return out
    dtd = F.softplus(dt.float() + dt_bias.float())
    y, new = scan_reference(
        x.unsqueeze(1), dtd.unsqueeze(1), A, B.unsqueeze(1), C.unsqueeze(1), D, state
    )
    state.copy_(new.to(state.dtype))
    return y[:, 0].to(x.dtype)


@ssm_step.register_fake
def _(state, x, dt, A, B, C, D, dt_bias):
    return torch.empty_like(x)


def _device_step(state, x, dt, A, B, C, D, dt_bias):
    from torch_spyre.kernels import ssd

    if x.dim() != 3 or x.dtype not in _FLOATS or state.dtype not in _FLOATS:
        return None
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    if state.shape != (b, h, p, n) or h % g or dt.shape != (b, h):
        return None
    dev = x.device
    hg = h // g
    dtd = F.softplus(dt.float() + dt_bias.float()).reshape(b, g, hg)
    key = ("ssm_step", b, g, hg, p, n, x.dtype, state.dtype)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            ssd.ssm_step(b, g, hg, p, n, x.dtype, state_dtype=state.dtype, config=cfg)
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return None
    y = torch.empty((b, h, p), dtype=x.dtype, device=dev)
    mem, whole = operands.device_memory, operands.whole
    st = whole(state)
    kern.launch_memory(
        dev.index or 0,
        {
            # [b, h, ...] holds the bytes of [b, g, hg, ...] (h is not the stick dim)
            "state": mem(st),
            "x": mem(whole(x)),
            "dt": mem(whole(dtd)),
            "A": mem(whole(A.float().reshape(g, hg))),
            "D": mem(whole(D.float().reshape(g, hg))),
            "B": mem(whole(B.float())),
            "C": mem(whole(C.float())),
            "y": mem(y),
        },
    )
    if st is not state:  # the state was a view: write the update back
        state.copy_(st)
    dispatch_stats.record("kernel", "ssm_step")
    return y


@torch.library.custom_op("spyre::rmsnorm_gated", mutates_args=())
def rmsnorm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * rmsnorm(x * silu(z))`` over the last dim (one group), in x's dtype."""
    if x.device.type == "spyre":
        out = _device_norm(x, z, weight, eps)
        if out is not None:
            return out
    h = x.float() * F.silu(z.float())
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@rmsnorm_gated.register_fake
def _(x, z, weight, eps):
    return torch.empty_like(x)


def _device_norm(x, z, weight, eps):
    from torch_spyre.kernels import ssd

    if x.dtype not in _FLOATS or z.dtype not in _FLOATS or z.shape != x.shape:
        return None
    if weight.shape != (x.shape[-1],):
        return None
    if torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        return None  # the output dtype would be the weight's
    k = x.shape[-1]
    m = x.numel() // k
    dev = x.device
    key = ("rmsnorm_gated", m, k, float(eps), x.dtype, weight.dtype, z.dtype)

    def build() -> launch.Kernel:
        cfg = cards.config(dev.index or 0)
        return launch.Kernel(
            ssd.rmsnorm_gated(m, k, float(eps), x.dtype, weight.dtype, z_dtype=z.dtype, config=cfg)
        )

    kern = launch.kernel(key, build)
    if kern.program is None:
        return None
    out = torch.empty((m, k), dtype=x.dtype, device=dev)
    whole = operands.whole
    kern.launch(
        {
            "x": whole(x.reshape(m, k)),
            "z": whole(z.reshape(m, k)),
            "w": whole(weight),
            "out": out,
        }
    )
    dispatch_stats.record("kernel", "rmsnorm_gated")
    return out.view(x.shape)
