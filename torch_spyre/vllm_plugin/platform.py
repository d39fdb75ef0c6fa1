"""SpyrePlatform: what vLLM asks a platform (device, worker, attention, config).

Towards vLLM the platform is an out-of-tree platform whose ``device_type`` is
"cpu", as IBM's Spyre plugins do: vLLM's scheduler, input batch, block tables and
sampler keep their tensors on the host, and the worker moves what the model needs
(weights, paged KV cache, token ids, positions, attention indices) to ``spyre``
where the layers run (model_runner.py, layers.py, attention.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from torch_spyre import settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM configures that logger tree


SPYRE = "spyre"
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: small pages suit short test/served prompts


class SpyrePlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = SPYRE
    device_type: str = "cpu"  # vLLM's bookkeeping tensors stay on the host
    dispatch_key: str = "CPU"
    # vLLM's device groups: spyre tensors between cards (host tensors over gloo)
    dist_backend: str = "spyreccl"
    ray_device_key: str = ""
    simple_compile_backend: str = "eager"
    #: fp8 weights (vllm_plugin/quantization.py); anything else is refused at start-up
    supported_quantization: list[str] = [
        "fp8",
        "fp8_per_tensor",
        "fp8_per_channel",
        "compressed-tensors",
    ]

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"spyre (simulated card {device_id})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(torch.spyre.get_device_properties(device_id).total_memory)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(torch.spyre.memory_allocated())

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # vLLM passes its (host) device; the spyre card is selected by the worker.
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.spyre.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        # The pure-Python vLLM build has no vllm._C: torch stand-ins for the one
        # op of it the fp8 path calls (quantising weights at load time).
        from torch_spyre.vllm_plugin import kernels

        kernels.register_c_ops()

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_sparse", False):
            raise NotImplementedError("sparse attention is not supported on spyre")
        if getattr(attn_selector_config, "use_mla", False):
            # latent attention from the latent cache (VLLM_MLA_DISABLE=1: expanded)
            from torch_spyre.vllm_plugin.mla import BACKEND_QUALNAME

            return BACKEND_QUALNAME
        from torch_spyre.vllm_plugin.attention import register_backend

        if selected_backend is not None and selected_backend.name != "CUSTOM":
            logger.info(
                "spyre: ignoring attention backend %s, using spyre attention", selected_backend
            )
        return register_backend()

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        # MLA prefill runs in the spyre MLA impl (mla.py), not a GPU prefill kernel
        from torch_spyre.vllm_plugin.mla import SpyreMLAPrefillBackend

        return SpyreMLAPrefillBackend

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Compiled forward: attention is one opaque custom op in the graph
        # (vllm::unified_attention_with_output), run by attention.py.
        from torch_spyre.vllm_plugin import compile as compile_mod

        return compile_mod.enabled()

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "torch_spyre.vllm_plugin.communicator.SpyreCommunicator"

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """vLLM's Triton helper kernels as pure torch (the empty build has no Triton).

        Once per process: vLLM calls this at every worker start (each ``LLM``
        of a process), and the overrides stay in place after the first."""
        global _overrides_registered
        if not _overrides_registered:
            register_kernel_overrides()
            _overrides_registered = True

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        parallel = vllm_config.parallel_config
        _check_parallel(parallel)
        start_method()
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "torch_spyre.vllm_plugin.worker.SpyreWorker"
        if parallel.world_size == 1:
            # The worker runs inside the engine-core process: no extra worker process.
            parallel.distributed_executor_backend = "uni"
        elif parallel.distributed_executor_backend in (None, "mp"):
            # tensor parallel: one worker process per card (card = local rank)
            parallel.distributed_executor_backend = "mp"
        else:
            raise NotImplementedError(
                f"spyre: tensor parallel runs with vLLM's multiprocessing executor "
                f"(--distributed-executor-backend mp), got "
                f"{parallel.distributed_executor_backend!r}"
            )
        parallel.disable_custom_all_reduce = True
        if getattr(parallel, "enable_dbo", False):
            parallel.enable_dbo = False

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE
        _one_state_block_per_request(vllm_config)
        env_kv = settings.get().vllm_kv_cache_bytes
        if env_kv and cache.kv_cache_memory_bytes is None:
            cache.kv_cache_memory_bytes = env_kv

        # No vLLM compilation (its piecewise backend, CUDA graphs): the model runner
        # compiles the forward itself with plain torch.compile, which reaches the
        # spyre Inductor backend, one graph per token bucket (compile.py), or runs
        # it eagerly with TORCH_SPYRE_VLLM_COMPILE=0.
        comp = vllm_config.compilation_config
        comp.mode = CompilationMode.NONE
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []
        # Every custom op dispatches to its forward_oot (the spyre layer).
        comp.custom_ops = ["all"]
        model = vllm_config.model_config
        if model is not None:
            # the user's --enforce-eager (no graphs) means our eager layers too;
            # vLLM's own compilation is always off here
            extra = vllm_config.additional_config
            if isinstance(extra, dict):
                extra.setdefault("spyre_eager", bool(model.enforce_eager))
            model.enforce_eager = True

        vllm_config.scheduler_config.async_scheduling = False
        _check_speculative(vllm_config.speculative_config)

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # multi-LoRA: adapters' stacks on the card, one grouped program per
        # projection (vllm_plugin/lora.py)
        return "torch_spyre.vllm_plugin.lora.SpyrePunicaWrapper"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # attention pages and Mamba state in separate card tensors (mamba.py)
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share layer indices with the target's
        # (model.layers.0 and draft_model.model.layers.0). The runner's flat
        # kv_caches list is only read by _zero_block_ids, which visits every
        # tensor once whatever the order: nothing to refuse.
        return None


_overrides_registered = False


def register_kernel_overrides() -> None:
    """``register_kernels(kernels.OVERRIDES)`` (vLLM's public hook).

    vLLM's registration scans every loaded module's globals for references to
    the kernels, and reads ``vars(x).get("kernel")`` of every global ``x`` with
    a ``__dict__``. llvmlite's ``llvmlite.binding.ffi.lib`` (loaded with numba,
    which vLLM's n-gram proposer uses) answers any attribute, ``__dict__``
    included, with a C-function wrapper, and the scan fails on it
    (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'). That
    module holds no vLLM kernel, so it is left out of ``sys.modules`` while the
    scan runs (no public hook narrows the scan; vLLM 0.32.0).
    test_vllm_spec_decode.py::test_overrides_register_with_llvmlite_loaded
    fails if this stops working."""
    import sys

    from vllm.triton_utils.dispatcher import register_kernels

    from torch_spyre.vllm_plugin import kernels

    hidden = {n: sys.modules.pop(n) for n in _SCAN_UNSAFE_MODULES if n in sys.modules}
    try:
        register_kernels(kernels.OVERRIDES)
    finally:
        sys.modules.update(hidden)


#: modules whose globals vLLM's kernel-override scan cannot read (see above)
_SCAN_UNSAFE_MODULES = ("llvmlite.binding.ffi",)


#: speculative decoding methods the spyre model runner serves
SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")


def _check_speculative(spec) -> None:
    """Speculative decoding: vLLM's n-gram (prompt lookup) proposer on the
    host, or a draft model, EAGLE / EAGLE-3 head or MTP layer on the card
    (drafter.py: its weights and paged KV cache in device memory, its forward
    eager spyre kernels; its input kernels in torch ops, draft_kernels.py);
    the verification forward over every request's k+1 positions on the card
    (one compiled forward per step), rejection sampling in torch ops
    (spec_decode.py).  Other methods are refused here, naming what works."""
    if spec is None:
        return
    if spec.method not in SPEC_METHODS:
        raise NotImplementedError(
            f"spyre: speculative decoding method {spec.method!r} is not supported; "
            f"supported: {', '.join(SPEC_METHODS)} (e.g. speculative_config="
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}, {"method": "draft_model", "model": <a smaller '
            'model with the same vocabulary>, "num_speculative_tokens": 3} or '
            '{"method": "eagle", "model": <an EAGLE head>, "num_speculative_tokens": 3}; '
            '"eagle3" with an EAGLE-3 head, "mtp" for a model with MTP layers)'
        )
    if spec.rejection_sample_method != "standard":
        raise NotImplementedError(
            f"spyre: speculative rejection_sample_method {spec.rejection_sample_method!r} "
            "is not supported; 'standard' is"
        )


def _one_state_block_per_request(vllm_config: VllmConfig) -> None:
    """Hybrid (Mamba + attention) models: vLLM's ``mamba_cache_mode="none"``,
    one Mamba state block per request.  Prefix caching would pick "align"
    (states copied between blocks at block boundaries), which the spyre runner
    does not implement; so it is turned off for these models."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None or not getattr(model, "is_hybrid", False):
        return
    if cache.mamba_cache_mode == "none" and not cache.enable_prefix_caching:
        return
    if cache.mamba_cache_mode not in ("none", "align"):
        raise NotImplementedError(
            f"spyre: mamba_cache_mode={cache.mamba_cache_mode!r}; the card keeps one Mamba "
            "state per request (mamba_cache_mode='none', no prefix caching)"
        )
    logger.info(
        "spyre: hybrid model: prefix caching off, one Mamba state block per request "
        "(mamba_cache_mode='none')"
    )
    cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len


def start_method() -> str:
    """The start method of vLLM's engine and worker processes: ``fork`` unless
    the user chose one (``VLLM_WORKER_MULTIPROC_METHOD``).

    ``vllm serve`` asks for ``spawn`` for every platform, since ``fork`` "is not
    compatible with some accelerators" (``cli_env_setup``, after the platform
    is chosen: ``MP_METHOD_AT_START`` holds what the user had set).  A spawned
    engine imports torch, vLLM and torch_spyre again, ~5 s of a ~20 s start
    here.  The simulated card has no driver and no thread that a fork could
    break (``runtime/device_module._is_in_bad_fork``) and the API server
    never allocates on it, so a forked engine starts from an unused card, as
    under vLLM's library path (``vllm.LLM`` forks by default).  vLLM's CPU
    platform makes the same choice the other way (``spawn``), in the same
    hook.
    """
    from torch_spyre import vllm_plugin

    chosen = vllm_plugin.MP_METHOD_AT_START
    if chosen is not None:
        return chosen
    now = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if now is None or now == "fork":
        return "fork"  # vLLM's default, left unwritten (no variable for the user's children)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    logger.info(
        "spyre: vLLM's engine processes are forked, not spawned "
        "(VLLM_WORKER_MULTIPROC_METHOD=spawn to spawn them)"
    )
    # This is `vllm serve`'s API server, about to fork the engine: its heap
    # is frozen now, as vLLM's server freezes it once it serves (vLLM's
    # freeze_gc_heap: collect, then gc.freeze), so that the forked engine's
    # collections skip the ~700k objects it inherits (Python's gc docs:
    # gc.freeze() before fork()).  Each full collection over them took ~0.4 s
    # here; vLLM's engine runs several while it starts.
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    return "fork"


def _check_parallel(parallel) -> None:
    """Tensor parallel over the system's cards; no pipeline/data parallel yet."""
    from torch_spyre.runtime.cards import MAX_CARDS, configured_num_cards

    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"spyre: pipeline parallel is not supported (got --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size}); use --tensor-parallel-size"
        )
    if getattr(parallel, "data_parallel_size", 1) > 1:
        raise NotImplementedError("spyre: data parallel is not supported; run one server per group")
    tp = parallel.tensor_parallel_size
    if tp > MAX_CARDS:
        raise ValueError(
            f"spyre: --tensor-parallel-size {tp} needs {tp} cards; a Spyre system holds at "
            f"most {MAX_CARDS}"
        )
    cards = configured_num_cards()
    if tp > cards:
        raise ValueError(
            f"spyre: --tensor-parallel-size {tp} needs {tp} cards but this system has {cards} "
            f"(TORCH_SPYRE_NUM_CARDS={cards}); set TORCH_SPYRE_NUM_CARDS={tp} or more"
        )
