"""SpyreModelRunner: vLLM's CPU model runner with the model and KV cache on the card.

vLLM's runner logic (input batch, scheduling output, block tables, sampling) is
reused from ``CPUModelRunner`` and stays on the host. What changes:

* ``load_model``: the model is built and loaded on the host by vLLM's loader
  (with the spyre layers of layers.py), then moved to ``spyre``: every weight and
  buffer (rotary table included) lives in device memory. A forward pre-hook moves
  the step's token ids and positions to the card.
* ``initialize_kv_cache_tensors``: one paged KV tensor per attention layer in
  device memory, in the layout of attention.py; a (conv, ssm) state pair per
  Mamba layer of hybrid models (mamba.py).
* ``_model_forward``: the forward compiled per token bucket (compile.py), unless
  ``TORCH_SPYRE_VLLM_COMPILE=0``;
* every step's modelled device time (``torch.spyre.modelled_time_s``) is logged
  and exported as Prometheus metrics (metrics.py);
* speculative decoding (n-gram, platform.SPEC_METHODS) is vLLM's own: the
  verification of every request's k+1 positions is one forward of the step's
  bucket, the LM head's row buckets hold k+1 rows per request, and the
  rejection sampler runs the torch kernels of spec_decode.py.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec, MLAAttentionSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from torch_spyre import settings, sim
from torch_spyre.vllm_plugin import compile as compile_mod
from torch_spyre.vllm_plugin import metrics
from torch_spyre.vllm_plugin.compile import CompiledForward, CompiledHead

logger = init_logger(f"vllm.{__name__}")  # vLLM configures the "vllm" tree

SPYRE = torch.device("spyre")


def _inputs_to_card(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the step's host tensors (ids, positions) go to the card."""
    moved = {
        k: v.to(SPYRE) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
        for k, v in kwargs.items()
    }
    args = tuple(a.to(SPYRE) if isinstance(a, torch.Tensor) else a for a in args)
    return args, moved


class SpyreModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        with _torch_threads_kept():  # vLLM's NgramProposer JIT-compiles with numba here
            super().__init__(vllm_config, device)
        self.step_stats = metrics.StepStats()
        self._step_start: tuple[float, float, float] | None = None
        self._step_tokens = 0
        self._step_reqs = 0

    # -- model ------------------------------------------------------------------
    def load_model(self, load_dummy_weights: bool = False) -> None:
        _check_fits(self.vllm_config, _checkpoint_bytes(self.model_config))
        super().load_model(load_dummy_weights)
        _check_fits(self.vllm_config, sum(_device_bytes(p) for p in self.model.parameters()))
        from torch_spyre.vllm_plugin.layers import SpyreEmbeddingMethod, SpyreRotary

        for m in self.model.modules():
            if isinstance(m, SpyreRotary):
                m.spyre_prepare()  # cos/sin tables as buffers, moved below
        before = torch.spyre.memory_allocated()
        t0 = time.perf_counter()
        self.model.to(SPYRE)
        self._check_on_card(self.model)
        self.model.register_forward_pre_hook(_inputs_to_card, with_kwargs=True)
        from torch_spyre.vllm_plugin import drafter

        if (draft := drafter.model_of(self)) is not None:
            drafter.to_card(draft)  # draft model / EAGLE head, loaded by vLLM above
        self.compiled: CompiledForward | None = None
        self.compiled_head: CompiledHead | None = None
        extra = self.vllm_config.additional_config
        user_eager = isinstance(extra, dict) and extra.get("spyre_eager", False)
        # vLLM's layers call attention through its custom ops, compiled or not
        compile_mod.register_spyre_attention_ops()
        from torch_spyre.vllm_plugin import mamba

        mamba.register_mixer_op()  # hybrid models' Mamba-2 layers, same way
        if compile_mod.enabled(pooling=self.is_pooling_model) and not user_eager:
            self.compiled = CompiledForward(
                self.model,
                self.scheduler_config.max_num_batched_tokens,
                self.vllm_config.compute_hash(),
            )
            self.compiled_head = CompiledHead(self._max_logit_rows())
            for m in self.model.modules():
                if isinstance(getattr(m, "quant_method", None), SpyreEmbeddingMethod):
                    # the LM head's matmul (tied or not); .embedding() stays in the graph
                    m.__dict__["spyre_compiled_head"] = self.compiled_head
            logger.info(
                "spyre: model forward compiled by the spyre torch.compile backend, "
                "one graph per token bucket %s (attention: opaque paged-KV op)",
                self.compiled.sizes,
            )
        logger.info(
            "spyre: model moved to the card: %.1f MiB of weights in device memory (%.1f s)",
            (torch.spyre.memory_allocated() - before) / 2**20,
            time.perf_counter() - t0,
        )

    def load_lora_model(self, model, vllm_config, device):
        """vLLM wraps the LoRA layers with their weight stacks on the host (the
        runner's device); they move to the card here (vllm_plugin/lora.py)."""
        from torch_spyre.vllm_plugin import lora

        model = super().load_lora_model(model, vllm_config, device)
        mib = lora.stacks_to_card(model) / 2**20
        logger.info("spyre: LoRA weight stacks in device memory: %.1f MiB", mib)
        return model

    def _max_logit_rows(self) -> int:
        """Rows the LM head runs on in one step: one per request, or with
        speculative decoding the k+1 verified positions of each (never more
        than the step's tokens)."""
        seqs = self.scheduler_config.max_num_seqs
        if not self.num_spec_tokens:
            return seqs
        return max(
            seqs,
            min(seqs * (1 + self.num_spec_tokens), self.scheduler_config.max_num_batched_tokens),
        )

    def warm_up(self) -> None:
        """Compile the token buckets before the server reports healthy.

        ``TORCH_SPYRE_VLLM_WARMUP``: ``all`` (default: every bucket up to
        ``max_num_batched_tokens``, and the LM head's row buckets), ``none``, or
        the token buckets to compile (e.g. ``16,64``).  Each is one forward of
        padding tokens with no attention metadata (vLLM's profiling-run
        convention: attention writes no cache and returns zeros), so it traces
        the graph real steps run; a progress line per bucket.
        """
        if self.compiled is None:
            return
        raw = settings.get().vllm_warmup.strip().lower()
        if raw in ("none", "0", "off", ""):
            return
        sizes = self.compiled.sizes
        if raw != "all":
            want = {int(x) for x in raw.split(",") if x.strip()}
            bad = want - set(sizes)
            if bad:
                raise ValueError(
                    f"TORCH_SPYRE_VLLM_WARMUP: {sorted(bad)} are not token buckets {sizes}"
                )
            sizes = [b for b in sizes if b in want]
        from vllm.forward_context import set_forward_context

        t_all = time.perf_counter()
        # inference mode, as vLLM runs steps: its tensors' dispatch keys are in the guards
        with torch.inference_mode(), sim.timing_only():
            for i, b in enumerate(sizes, 1):
                t0 = time.perf_counter()
                # the dtypes of vLLM's own input buffers (guards check them)
                ids = torch.zeros(b, dtype=_dtype(self.input_ids))
                pos = torch.zeros(b, dtype=_dtype(self.positions))
                with set_forward_context(None, self.vllm_config, num_tokens=b):
                    hidden = self.compiled.warm_up(ids, pos)
                    if self.lora_config:  # the bucket's graph with the LoRA ops too
                        from torch_spyre.vllm_plugin import lora

                        with lora.lora_graph():
                            self.compiled.warm_up(ids, pos)
                logger.info(
                    "spyre: warm-up %d/%d: the %d-token bucket compiled in %.1f s",
                    i, len(sizes), b, time.perf_counter() - t0,
                )  # fmt: skip
            if self.compiled_head is not None:
                head = self._lm_head_weights()
                for rows in self.compiled_head.sizes if head is not None else ():
                    x = hidden[:1].expand(rows, -1).contiguous()
                    self.compiled_head._run(x, *head)
        logger.info(
            "spyre: warm-up done in %.1f s (%d forward graphs, %d LM-head graphs)",
            time.perf_counter() - t_all,
            self.compiled.graphs,
            0 if self.compiled_head is None else self.compiled_head.graphs,
        )

    def _lm_head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) for the compiled head's graph: a [vocab, hidden] weight
        of the layers it serves (layers.py; the weight is a graph input, so any of
        that shape traces the same graph) and no bias, as the logits processor calls it."""
        for m in self.model.modules():
            if m.__dict__.get("spyre_compiled_head") is self.compiled_head:
                return m.weight, None
        return None

    def _model_forward(
        self,
        input_ids=None,
        positions=None,
        intermediate_tensors=None,
        inputs_embeds=None,
        **model_kwargs,
    ):
        if self.compiled is None:
            return super()._model_forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs
            )
        return self.compiled(
            input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs
        )

    def _pool(self, hidden_states, num_scheduled_tokens, num_scheduled_tokens_np, *args, **kw):
        """Pooling models (embeddings, cross-encoder scores): vLLM's pooler runs
        on the card over the hidden states there; its token cursor must be on
        the hidden states' device, which vLLM takes from ``query_start_loc.gpu``
        (a host tensor for this CPU-typed runner)."""
        qsl = self.query_start_loc
        self.query_start_loc = _OnCard(qsl)
        try:
            return super()._pool(
                hidden_states, num_scheduled_tokens, num_scheduled_tokens_np, *args, **kw
            )
        finally:
            self.query_start_loc = qsl

    @staticmethod
    def _check_on_card(model: torch.nn.Module) -> None:
        stray = [
            name
            for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type != "spyre" and t.numel() > 1
        ]
        if stray:
            raise RuntimeError(f"spyre: tensors left off the card after .to('spyre'): {stray[:5]}")

    # -- KV cache ---------------------------------------------------------------
    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: AbstractContextManager | None = None,
    ) -> dict[str, torch.Tensor]:
        """Paged KV tensors for attention layers, (conv, ssm) state tensors for
        Mamba layers (hybrid models: mamba.py), each its own card tensor.

        vLLM's GPU runner overlays the groups' layers in one int8 buffer
        (``allocate_kv_cache``); card tensors are laid out in sticks, so their
        bytes cannot be reinterpreted as another layer's views: the block ids
        of every group index their own tensors instead."""
        from torch_spyre.vllm_plugin import mamba
        from torch_spyre.vllm_plugin.attention import SpyreAttentionBackend
        from torch_spyre.vllm_plugin.mla import SpyreMLABackend

        before = torch.spyre.memory_allocated()
        kv_caches: dict[str, torch.Tensor] = {}
        states: dict[str, tuple[torch.Tensor, ...]] = {}
        num_blocks = kv_cache_config.num_blocks
        block_size = None
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                for name in group.layer_names:
                    states[name] = mamba.allocate_states(spec, num_blocks)
                continue
            if not isinstance(spec, AttentionSpec):
                raise NotImplementedError(
                    f"spyre: KV cache group of type {type(spec).__name__} is not supported "
                    "(attention and Mamba state groups are)"
                )
            if kernel_block_sizes and kernel_block_sizes[gid] != spec.block_size:
                raise NotImplementedError(
                    f"spyre: kernel block size {kernel_block_sizes[gid]} != block size "
                    f"{spec.block_size}"
                )
            block_size = spec.block_size
            # latent attention (MLA): one [kv_c | k_pe] row per token (mla.py)
            backend = (
                SpyreMLABackend if isinstance(spec, MLAAttentionSpec) else SpyreAttentionBackend
            )
            shape = backend.get_kv_cache_shape(
                num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
            )
            for name in group.layer_names:
                if name in self.shared_kv_cache_layers:
                    continue
                kv_caches[name] = torch.zeros(shape, dtype=spec.dtype, device=SPYRE)
        for name, target in self.shared_kv_cache_layers.items():
            kv_caches[name] = kv_caches[target]
        bind_kv_cache(
            kv_caches,
            self.compilation_config.static_forward_context,
            self.kv_caches,
            kv_cache_groups=kv_cache_config.kv_cache_groups,
        )
        ctx = self.compilation_config.static_forward_context
        for name, st in states.items():
            ctx[name].bind_kv_cache(st)  # SpyreMambaMixer2 takes the tuple
        first = next(iter(kv_caches.values()), None)
        logger.info(
            "spyre: paged KV cache in device memory: %d layers x %d blocks of %s tokens; "
            "per layer %s = [k/v, block, token, kv_head, head_dim] (latent attention: "
            "[block, 1, token, latent]); %d Mamba layers' state "
            "%s = [block, ...]; %.1f MiB in all",
            len(kv_caches),
            num_blocks,
            block_size,
            None if first is None else list(first.shape),
            len(states),
            [list(t.shape) for t in next(iter(states.values()), ())],
            (torch.spyre.memory_allocated() - before) / 2**20,
        )
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        # Layout [2, num_blocks, ...]: the block is dim 1 (CPUModelRunner assumes 0);
        # the latent (MLA) cache [num_blocks, 1, block_size, latent]: dim 0.
        # Mamba states need no zeroing: a new request starts from zeros (mamba.py).
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64, device=SPYRE)
        seen: set[int] = set()
        for kv in self.kv_caches:
            if kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            kv.index_fill_(1 if kv.dim() == 5 else 0, idx, 0)

    # -- speculative decoding ----------------------------------------------------
    def propose_draft_token_ids(self, *args: Any, **kwargs: Any):
        """vLLM's drafter (the n-gram proposer, platform.SPEC_METHODS) on the host.

        Its numba kernels run on numba's OpenMP threading layer, which sets the
        OpenMP thread count that torch reads as ``torch.get_num_threads()``; the
        compiled forward's guards include that count, so a change would
        recompile every token bucket at the next step. The count is put back."""
        with _torch_threads_kept():
            return super().propose_draft_token_ids(*args, **kwargs)

    # -- per-step modelled time -------------------------------------------------
    def execute_model(self, scheduler_output, *args: Any, **kwargs: Any):
        self._step_start = (torch.spyre.modelled_time_s(), time.perf_counter(), _collective_s())
        self._step_tokens = scheduler_output.total_num_scheduled_tokens
        self._step_reqs = len(scheduler_output.num_scheduled_tokens)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        if out is not None:  # no sampling follows (e.g. nothing scheduled)
            self._end_step()
        return out

    def sample_tokens(self, *args: Any, **kwargs: Any):
        out = super().sample_tokens(*args, **kwargs)
        self._end_step()
        return out

    def _end_step(self) -> None:
        if self._step_start is None or self._step_tokens == 0:
            self._step_start = None
            return
        mod0, wall0, coll0 = self._step_start
        self._step_start = None
        self.step_stats.record(
            tokens=self._step_tokens,
            reqs=self._step_reqs,
            modelled_s=torch.spyre.modelled_time_s() - mod0,
            wall_s=time.perf_counter() - wall0,
            collective_s=_collective_s() - coll0,
        )


@contextmanager
def _torch_threads_kept():
    """Restore ``torch.get_num_threads()`` after the block (see propose_draft_token_ids)."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def _collective_s() -> float:
    """Modelled collective time of this worker's card so far (tensor parallel)."""
    from torch_spyre.runtime import cards

    return cards.card(torch.spyre.current_device()).stats()["collective_time_s"]


class _OnCard:
    """A CpuGpuBuffer whose device half is on the card (see _pool)."""

    def __init__(self, buf) -> None:
        self._buf = buf
        self.gpu = buf.gpu.to(SPYRE)

    def __getattr__(self, name: str):
        return getattr(self._buf, name)


def _dtype(buf) -> torch.dtype:
    """The dtype of one of vLLM's input buffers (a CpuGpuBuffer or a tensor)."""
    return buf.gpu.dtype if hasattr(buf, "gpu") else buf.dtype


def _device_bytes(t: torch.Tensor) -> int:
    """Device bytes a host tensor takes on the card (whole sticks, padding included)."""
    from torch_spyre.layout import SpyreTensorLayout

    return SpyreTensorLayout.default(tuple(t.shape), t.dtype).nbytes


def _checkpoint_bytes(model_config) -> int | None:
    """Weight bytes in the serving dtype, from the local safetensors headers (no
    loading); None when the checkpoint is not local safetensors."""
    import json
    import struct
    from pathlib import Path

    folder = Path(str(model_config.model))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    itemsize = model_config.dtype.itemsize
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel * itemsize
    return total


# The simulated card's device memory is host memory: without an explicit size the
# KV cache takes gpu_memory_utilization of the free device memory, capped here so a
# 112 GiB simulated card does not allocate that much host RAM.
DEFAULT_KV_CACHE_CAP = 1 << 30


def planned_kv_cache_bytes(cache_config, free: int) -> int:
    """The KV cache the worker will allocate with ``free`` device bytes left."""
    if cache_config.kv_cache_memory_bytes is not None:
        return int(cache_config.kv_cache_memory_bytes)
    return min(int(max(free, 0) * cache_config.gpu_memory_utilization), DEFAULT_KV_CACHE_CAP)


def _check_fits(vllm_config, weight_bytes: int | None) -> None:
    """Weights plus the KV cache against the card's device memory, before either
    is allocated: a clear error naming both and what to change."""
    if weight_bytes is None:
        return
    free, total = torch.spyre.mem_get_info()
    kv = planned_kv_cache_bytes(vllm_config.cache_config, free - weight_bytes)
    if weight_bytes + kv > free:
        raise ValueError(
            f"spyre: the model does not fit on the card: its weights take "
            f"{weight_bytes / 2**30:.2f} GiB and the KV cache {kv / 2**30:.2f} GiB of device "
            f"memory, {(weight_bytes + kv) / 2**30:.2f} GiB in all, but {free / 2**30:.2f} GiB "
            f"of {total / 2**30:.2f} GiB are free. Set a smaller --kv-cache-memory-bytes, a "
            "16-bit --dtype, or a larger card (TORCH_SPYRE_DEVICE_MEMORY)."
        )
