"""SpyreWorker: vLLM's CPU worker minus its C++ extension, sized by spyre memory."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
import vllm.utils.torch_utils as _torch_utils
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

from torch_spyre.vllm_plugin import metrics
from torch_spyre.vllm_plugin.model_runner import SpyreModelRunner, planned_kv_cache_bytes

logger = init_logger(f"vllm.{__name__}")  # vLLM configures the "vllm" tree


def _async_tensor_h2d(data, device=None, dtype=None, out=None) -> torch.Tensor:
    """vLLM's ``async_tensor_h2d`` (host data to ``device`` or into ``out``), unpinned."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if not isinstance(data, torch.Tensor):
        data = torch.tensor(data, dtype=dtype)
    if out is not None:
        return out.copy_(data)
    return data.to(device=device, dtype=dtype)


# vLLM's CPU worker module imports vllm/v1/worker/cpu/shm.py, which replaces
# vllm.utils.torch_utils.async_tensor_h2d process-wide with a copy that ignores
# ``device`` (everything is the host for the CPU platform).  Its poolers move
# prompt lengths to the hidden states' device with it -- the card here -- and then
# mix devices.  vLLM has no hook for this; we put back a copy that honours the
# device (tests/vllm/test_vllm_plugin.py fails if the patch is lost).
def _restore_async_tensor_h2d() -> None:
    host_only = _torch_utils.async_tensor_h2d
    _torch_utils.async_tensor_h2d = _async_tensor_h2d
    # modules that imported it by name while the host-only one was in place
    for mod in list(sys.modules.values()):
        if getattr(mod, "async_tensor_h2d", None) is host_only and mod is not _torch_utils:
            if (
                getattr(mod, "__name__", "").startswith("vllm.")
                and "worker.cpu.shm" not in mod.__name__
            ):
                mod.async_tensor_h2d = _async_tensor_h2d


_restore_async_tensor_h2d()

# The same module also replaces ``torch.Event`` process-wide with a placeholder
# that has only record/wait/synchronize, so after an engine ran in a process,
# ``torch.Event(device="spyre")`` lost ``elapsed_time`` and ``query`` for every
# other user of that process (a notebook, a test run).  torch.Event is the
# device-generic event our streams use; vLLM's CPU runner sets its own
# placeholder while it builds (cpu_model_runner._torch_cuda_wrapper) and needs
# none after, so the real class is put back (torch.cuda.* stays vLLM's: no
# CUDA here).  vLLM has no hook for this; tests/vllm/test_vllm_plugin.py fails
# if it is lost.
torch.Event = torch._C.Event


def freeze_inherited_heap() -> bool:
    """In a forked engine or worker (vLLM's library path forks too), freeze the
    heap it inherited, so that its collections (vLLM runs several while it
    loads a model) skip those objects (``platform.start_method``).  True when
    it froze; nothing in a process that was not started by multiprocessing."""
    if multiprocessing.parent_process() is None:
        return False
    gc.freeze()
    return True


class SpyreWorker(CPUWorker):
    def __init__(
        self,
        vllm_config,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        # Skip CPUWorker.__init__: it binds NUMA memory through vllm._C, which the
        # pure-Python vLLM build lacks and the simulated card does not need.
        Worker.__init__(
            self,
            vllm_config,
            local_rank,
            rank,
            distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        self.parallel_config.disable_custom_all_reduce = True
        freeze_inherited_heap()

    def init_device(self) -> None:
        self.device = torch.device("cpu")  # vLLM's bookkeeping device (platform.py)
        if not torch.spyre.is_available():
            raise RuntimeError("spyre: no spyre device (torch_spyre failed to load?)")
        # one card per worker: tensor-parallel rank r runs on card r ("spyre"
        # without an index, as the runner and layers use it, is this card)
        if self.local_rank >= torch.spyre.device_count():
            raise RuntimeError(
                f"spyre: worker {self.local_rank} has no card: {torch.spyre.device_count()} "
                f"cards (set TORCH_SPYRE_NUM_CARDS to the tensor-parallel size or more)"
            )
        torch.spyre.set_device(self.local_rank)
        init_method = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init_method.removeprefix("file://"))
            if init_method.startswith("file://")
            else init_method.split(":")[-1]
        )
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            # groups left by an earlier engine of this process (LLM objects
            # built one after another): rebuild them for this model, e.g. the
            # expert-parallel group only a MoE model creates
            parallel_state.destroy_model_parallel()
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = SpyreModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        return nullcontext()  # no CuMem pools: the spyre allocator owns device memory

    def _should_warm_up_model(self) -> bool:
        return False  # vLLM's own warm-up: our buckets compile in compile_or_warm_up_model

    def compile_or_warm_up_model(self):
        """Compile the token buckets before the engine reports ready (model_runner.warm_up)."""
        times = super().compile_or_warm_up_model()
        self.model_runner.warm_up()
        metrics.export()  # the spyre:* series exist from the moment /health is 200
        return times

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache in spyre device memory."""
        explicit = self.cache_config.kv_cache_memory_bytes
        free, total = torch.spyre.mem_get_info()
        if explicit is not None and explicit > free:
            raise ValueError(
                f"spyre: kv_cache_memory_bytes={explicit} exceeds the free device "
                f"memory ({free} of {total} bytes; TORCH_SPYRE_DEVICE_MEMORY sets it)"
            )
        size = planned_kv_cache_bytes(self.cache_config, free)
        logger.info(
            "spyre: %.1f MiB of device memory for the KV cache (%.1f MiB free of %.1f MiB)",
            size / 2**20,
            free / 2**20,
            total / 2**20,
        )
        from torch_spyre.vllm_plugin.mamba import hybrid_cache_budget

        # hybrid models: every layer has its own card tensors, which vLLM's
        # block count would overshoot (mamba.py); vLLM is told the scaled figure
        reported = hybrid_cache_budget(
            self.vllm_config, self.model_runner.get_kv_cache_spec(), size
        )
        if reported != size:
            logger.info(
                "spyre: hybrid model: %.1f MiB reported to vLLM's block count, so that its "
                "per-layer attention pages and Mamba states take %.1f MiB on the card",
                reported / 2**20,
                size / 2**20,
            )
        return reported
