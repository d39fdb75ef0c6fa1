"""vLLM's Mamba-2 layers (Granite 4 / Bamba hybrids) on the card.

vLLM's ``MambaMixer2`` runs its state-space part through Triton kernels
(``causal_conv1d_fn`` / ``causal_conv1d_update``, ``mamba_chunk_scan_combined_varlen``,
``selective_state_update``) that the pure-Python build lacks.  Here:

* ``SpyreMambaMixer2`` (``PluggableLayer.register_oot`` for ``MambaMixer2``)
  keeps vLLM's projections, weights and loaders and replaces
  ``conv_ssm_forward`` with the card's programs: the causal depthwise conv1d
  (``F.conv1d(groups=channels)``: ops/conv.py), ``spyre::ssd_chunk_scan``
  (prefill) and ``spyre::ssm_step`` (decode), both ops/ssm.py, the same ones
  the transformers path uses (models/ssm.py);
* ``SpyreMixer2RMSNormGated`` (``CustomOp.register_oot``) is
  ``spyre::rmsnorm_gated`` for one group (else vLLM's reference formula);
* ``SpyreMamba2AttentionBackend`` overrides vLLM's ``MAMBA2`` backend
  (``register_backend(..., is_mamba=True)``): vLLM's own metadata builder
  (decode/prefill split, state indices, initial-state flags) plus a few index
  tensors moved to the card once per step and shared by every Mamba layer.

State cache (allocated by the model runner, ``allocate_states``): per Mamba
layer two card tensors with vLLM's ``MambaSpec`` shapes and dtypes,
``conv [num_blocks, K-1, conv_dim]`` (vLLM's default "SD" layout: the last K-1
inputs, time-major) and ``ssm [num_blocks, heads, head_dim, d_state]``.  A
request's state lives in the row of its one Mamba block (vLLM's
``mamba_cache_mode="none"``: ``block_table[req, 0]``).

Per step, requests come decodes first (vLLM reorders the batch for Mamba):

* decodes: the K-1 cached inputs + the new one as a [D, C, K] window -> one
  conv (padding 0), the window's tail written back; ``ssm_step`` on the
  gathered states, written back with ``index_copy_``;
* prefills: one batch of R requests padded to the longest query S (gathered
  by ``tok_index``), the cached conv inputs (zero without an initial state)
  prepended -> one conv; one ``ssd_chunk_scan`` of [R, S] from the gathered
  initial states.  Padded positions get ``dt = -1e4``: ``softplus`` makes it 0,
  so ``exp(dt * A) = 1`` and ``dt * x = 0`` -- the state passes them unchanged
  and the final state is the one after each request's last real token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp, PluggableLayer
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, Mixer2RMSNormGated
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.mamba2_attn import (
    Mamba2AttentionBackend,
    Mamba2AttentionMetadata,
    Mamba2AttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import MambaSpec

import torch_spyre.ops.conv  # noqa: F401  (the depthwise conv1d kernel)
import torch_spyre.ops.ssm  # noqa: F401  (spyre::ssd_chunk_scan, ssm_step, rmsnorm_gated)

SPYRE = torch.device("spyre")
#: dt of padded prefill positions: softplus(-1e4 + dt_bias) == 0 in fp16/fp32
PAD_DT = -1.0e4


# -- per-step indices ----------------------------------------------------------
@dataclass
class MambaCardIndices:
    """The step's Mamba indices on the card (host ints for the shapes)."""

    num_decodes: int
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int  # S: the prefill batch's padded length
    state_d: torch.Tensor | None  # [D] int64: state row of each decode
    state_p: torch.Tensor | None  # [R] int64: state row of each prefill
    init_p: torch.Tensor | None  # [R] model dtype: 1 if the prefill continues a state
    tok_index: torch.Tensor | None  # [R*S] int64: prefill token row of each padded position
    valid: torch.Tensor | None  # [R*S] bool: a real token
    out_index: torch.Tensor | None  # [Tp] int64: each prefill token's row in [R*S]
    tail_index: torch.Tensor | None  # [R*(K-1)] int64: rows of the new conv state


def build_indices(
    meta: Mamba2AttentionMetadata, conv_len: int, dtype: torch.dtype
) -> MambaCardIndices:
    """Host-side indices from vLLM's Mamba2 metadata, moved to the card."""
    nd, npf = meta.num_decodes, meta.num_prefills
    state_d = state_p = init_p = tok_index = valid = out_index = tail_index = None
    s_max = 0
    if nd:
        state_d = meta.state_indices_tensor_d[:nd, 0].to(torch.int64)
    if npf:
        qsl = meta.query_start_loc_p.to(torch.int64).cpu()
        lens = qsl[1:] - qsl[:-1]
        s_max = int(lens.max())
        pos = torch.arange(s_max, dtype=torch.int64)
        ok = pos[None, :] < lens[:, None]  # [R, S]
        tok_index = torch.where(ok, qsl[:-1, None] + pos[None, :], 0).reshape(-1)
        valid = ok.reshape(-1)
        out_index = torch.cat(
            [r * s_max + torch.arange(int(n), dtype=torch.int64) for r, n in enumerate(lens)]
        )
        # padded conv input per request: [K-1 cached, S new]; the new state is the
        # K-1 inputs before position len (row r*(K-1+S) + len + j)
        j = torch.arange(conv_len, dtype=torch.int64)
        tail_index = (
            torch.arange(npf, dtype=torch.int64)[:, None] * (conv_len + s_max) + lens[:, None] + j
        ).reshape(-1)
        state_p = meta.state_indices_tensor_p.to(torch.int64)
        has = meta.has_initial_states_p
        init = torch.zeros(npf) if has is None else has.to(torch.float32)
        init_p = init.to(dtype)

    def card(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu().to(SPYRE)

    return MambaCardIndices(
        num_decodes=nd,
        num_prefills=npf,
        num_prefill_tokens=meta.num_prefill_tokens,
        max_query_len=s_max,
        state_d=card(state_d),
        state_p=card(state_p),
        init_p=card(init_p),
        tok_index=card(tok_index),
        valid=card(valid),
        out_index=card(out_index),
        tail_index=card(tail_index),
    )


@dataclass
class SpyreMamba2Metadata(Mamba2AttentionMetadata):
    spyre: MambaCardIndices | None = None


class SpyreMamba2MetadataBuilder(Mamba2AttentionMetadataBuilder):
    """vLLM's Mamba2 builder (host) plus the card indices, once per step."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        spec: MambaSpec = self.kv_cache_spec
        conv_len = spec.shapes[0][-1 if is_conv_state_dim_first() else 0]
        dtype = self.vllm_config.model_config.dtype
        values = {f.name: getattr(meta, f.name) for f in fields(meta)}
        return SpyreMamba2Metadata(**values, spyre=build_indices(meta, conv_len, dtype))


class SpyreMamba2AttentionBackend(Mamba2AttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[SpyreMamba2MetadataBuilder]:
        return SpyreMamba2MetadataBuilder


# -- the layers ------------------------------------------------------------------
class SpyreMixer2RMSNormGated(Mixer2RMSNormGated):
    """``w * rmsnorm(x * silu(gate))`` as one card program (one group, no TP)."""

    def forward_oot(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not self.use_rms_norm or self.n_groups != 1 or self.tp_size != 1:
            return self.forward_native(x, gate)
        return torch.ops.spyre.rmsnorm_gated(x, gate, self.weight, float(self.variance_epsilon))


class SpyreMambaMixer2(MambaMixer2):
    """vLLM's Mamba-2 mixer with the conv + SSM part on the card (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = {
            "tensor parallelism": self.tp_size != 1,
            "speculative decoding": self.num_spec > 0,
            "ReplaySSM (--use-replayssm)": self.use_replayssm,
            f"activation {self.activation!r}": self.activation not in ("silu", "swish"),
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(
                f"spyre Mamba-2 ({self.prefix}): {', '.join(bad)} not supported on the card; "
                "serve without them"
            )

    def bind_kv_cache(self, kv_cache) -> None:
        """The runner binds (conv, ssm) card tensors directly (no int8 page views:
        a card tensor's bytes are in stick layout, not reinterpretable)."""
        if isinstance(kv_cache, tuple):
            self.kv_cache = kv_cache
            return
        super().bind_kv_cache(kv_cache)

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor) -> None:
        """What vLLM's Triton kernels do, on the card (module docstring); vLLM's
        ``forward`` (projections, the gated norm) is unchanged."""
        from vllm.forward_context import get_forward_context

        raw = get_forward_context().attn_metadata
        meta = raw.get(self.prefix) if isinstance(raw, dict) else None
        if meta is None:  # profiling / warm-up: no state yet
            output.zero_()
            return
        idx: MambaCardIndices | None = getattr(meta, "spyre", None)
        if idx is None:
            raise RuntimeError(
                f"spyre Mamba-2 ({self.prefix}): metadata of {type(meta).__name__}, not "
                "the spyre Mamba2 backend's (was torch_spyre.vllm_plugin.mamba.register() "
                "called before the model was built?)"
            )
        if is_conv_state_dim_first():
            raise NotImplementedError(
                "spyre Mamba-2: VLLM_SSM_CONV_STATE_LAYOUT=DS; the card keeps the conv state "
                "time-major (SD, vLLM's default): unset it"
            )
        conv_state, ssm_state = self.kv_cache[0], self.kv_cache[1]
        i_sz, c_sz = self.tped_intermediate_size, self.tped_conv_size
        xbc = projected_states[..., i_sz : i_sz + c_sz]
        dt = projected_states[..., i_sz + c_sz : i_sz + c_sz + self.tped_dt_size]
        nd, npf = idx.num_decodes, idx.num_prefills
        if nd:
            output[:nd].copy_(self._decode(xbc[:nd], dt[:nd], conv_state, ssm_state, idx))
        if npf:
            t0, t1 = nd, nd + idx.num_prefill_tokens
            y = self._prefill(xbc[t0:t1], dt[t0:t1], conv_state, ssm_state, idx, meta.chunk_size)
            output[t0:t1].copy_(y)
        n = nd + idx.num_prefill_tokens
        if output.shape[0] > n:
            output[n:].zero_()  # a compiled bucket's padding rows (never read back)

    # conv weights as nn.Conv1d takes them: [C, 1, K]
    def _conv_weight(self) -> torch.Tensor:
        w = self.conv1d.weight
        return w if w.dim() == 3 else w.unsqueeze(1)

    def _split(self, x: torch.Tensor):
        g, n = self.n_groups // self.tp_size, self.ssm_state_size
        xs, b, c = torch.split(x, [self.tped_intermediate_size, g * n, g * n], dim=-1)
        return xs, b, c

    def _decode(self, xbc, dt, conv_state, ssm_state, idx: MambaCardIndices) -> torch.Tensor:
        d = idx.num_decodes
        prev = conv_state.index_select(0, idx.state_d)  # [D, K-1, C]
        win = torch.cat([prev, xbc.unsqueeze(1).to(prev.dtype)], dim=1)  # [D, K, C]
        conv_state.index_copy_(0, idx.state_d, win[:, 1:].contiguous())
        w = self._conv_weight()
        y = F.conv1d(win.transpose(1, 2).to(w.dtype), w, self.conv1d.bias, groups=w.shape[0])
        y = F.silu(y[:, :, 0])  # [D, C]
        xs, b, c = self._split(y)
        h, p = self.num_heads // self.tp_size, self.head_dim
        g = self.n_groups // self.tp_size
        st = ssm_state.index_select(0, idx.state_d)  # [D, h, p, n]
        out = torch.ops.spyre.ssm_step(
            st,
            xs.reshape(d, h, p).contiguous(),
            dt.contiguous(),
            self.A,
            b.reshape(d, g, -1).contiguous(),
            c.reshape(d, g, -1).contiguous(),
            self.D,
            self.dt_bias,
        )
        ssm_state.index_copy_(0, idx.state_d, st)
        return out.reshape(d, h * p)

    def _prefill(
        self, xbc, dt, conv_state, ssm_state, idx: MambaCardIndices, chunk_size: int
    ) -> torch.Tensor:
        r, s = idx.num_prefills, idx.max_query_len
        csz = xbc.shape[-1]
        x = xbc.index_select(0, idx.tok_index).view(r, s, csz)
        init = idx.init_p
        prev = conv_state.index_select(0, idx.state_p) * init.view(r, 1, 1).to(conv_state.dtype)
        inp = torch.cat([prev.to(x.dtype), x], dim=1)  # [R, K-1+S, C]
        tail = inp.reshape(-1, csz).index_select(0, idx.tail_index).view(r, -1, csz)
        conv_state.index_copy_(0, idx.state_p, tail.to(conv_state.dtype))
        w = self._conv_weight()
        y = F.silu(F.conv1d(inp.transpose(1, 2), w, self.conv1d.bias, groups=w.shape[0]))
        xs, b, c = self._split(y.transpose(1, 2))  # [R, S, *]
        h, p = self.num_heads // self.tp_size, self.head_dim
        g = self.n_groups // self.tp_size
        dtp = dt.index_select(0, idx.tok_index)
        dtp = torch.where(idx.valid[:, None], dtp, torch.full_like(dtp, PAD_DT)).view(r, s, h)
        st0 = ssm_state.index_select(0, idx.state_p).float() * init.view(r, 1, 1, 1).float()
        yss, final = torch.ops.spyre.ssd_chunk_scan(
            xs.reshape(r, s, h, p).contiguous(),
            dtp.contiguous(),
            self.A,
            b.reshape(r, s, g, -1).contiguous(),
            c.reshape(r, s, g, -1).contiguous(),
            self.D,
            self.dt_bias,
            st0,
            int(chunk_size),
            0.0,
            float("inf"),
        )
        ssm_state.index_copy_(0, idx.state_p, final.to(ssm_state.dtype))
        out = yss.reshape(r * s, h * p).index_select(0, idx.out_index)
        return out.to(xbc.dtype)


# -- state cache -------------------------------------------------------------------
def allocate_states(spec: MambaSpec, num_blocks: int) -> tuple[torch.Tensor, ...]:
    """One card tensor per state of a Mamba layer: ``[num_blocks, *shape]``."""
    return tuple(
        torch.zeros((num_blocks, *shape), dtype=dtype, device=SPYRE)
        for shape, dtype in zip(spec.shapes, spec.dtypes)
    )


def hybrid_cache_budget(vllm_config, specs: dict, budget: int) -> int:
    """The budget to report to vLLM so that the card tensors of a hybrid model
    take about ``budget`` bytes.

    vLLM sizes ``num_blocks`` as if the groups' layers shared one buffer per
    block (``get_kv_cache_config_from_groups``), Mamba pages padded to the
    attention page; here every layer has its own card tensors
    (``allocate_states`` and the paged KV), each padded to whole sticks.  The
    budget is scaled by vLLM's bytes per block over the card's."""
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    from torch_spyre.layout import SpyreTensorLayout

    if not any(isinstance(s, MambaSpec) for s in specs.values()) or budget <= 0:
        return budget
    groups = get_kv_cache_groups(vllm_config, specs)
    n = get_kv_cache_config_from_groups(vllm_config, groups, budget).num_blocks
    if n <= 0:
        return budget
    card = 0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            shapes = [((n, *sh), dt) for sh, dt in zip(spec.shapes, spec.dtypes)]
        else:
            shapes = [((2, n, spec.block_size, spec.num_kv_heads, spec.head_size), spec.dtype)]
        card += sum(SpyreTensorLayout.default(sh, dt).nbytes for sh, dt in shapes)
    return int(budget * budget / max(card, 1))


# -- registration ------------------------------------------------------------------
_registered: list[bool] = []


def register() -> None:
    """The layer classes, the Mamba2 backend and the mixer op on PrivateUse1 (idempotent)."""
    if _registered:
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

    if op_registry_oot.get("MambaMixer2") is not SpyreMambaMixer2:
        PluggableLayer.register_oot(SpyreMambaMixer2, name="MambaMixer2")
    if op_registry_oot.get("Mixer2RMSNormGated") is not SpyreMixer2RMSNormGated:
        CustomOp.register_oot(SpyreMixer2RMSNormGated, name="Mixer2RMSNormGated")
    register_backend(
        MambaAttentionBackendEnum.MAMBA2,
        f"{__name__}.{SpyreMamba2AttentionBackend.__qualname__}",
        is_mamba=True,
    )
    _registered.append(True)


_lib: list[torch.library.Library] = []


def register_mixer_op() -> None:
    """``vllm::mamba_mixer2`` is registered for the platform's dispatch key (CPU)
    with no fake: the same function serves spyre tensors, and a fake (it only
    writes ``output``) lets the compiled forward keep it as an opaque node."""
    if _lib:
        return
    from vllm.model_executor.layers.mamba import mamba_mixer2 as m2

    lib = torch.library.Library("vllm", "IMPL")
    lib.impl("mamba_mixer2", m2.mamba_mixer2, "PrivateUse1")
    try:
        torch.library.register_fake("vllm::mamba_mixer2", lambda *a, **k: None, lib=lib)
    except RuntimeError:  # vLLM registered one
        pass
    _lib.append(lib)
