"""vLLM's device communicator for spyre: its collectives over ``spyreccl``.

The platform names ``spyreccl`` as vLLM's torch.distributed backend
(platform.py), so every ``GroupCoordinator.device_group`` is a spyreccl
process group (spyre tensors between the cards, host tensors over its gloo)
and vLLM's base communicator's ``dist.*`` calls reach the cards.  What differs
from the base: receive buffers are made on this worker's card, and the group
is checked to be spyreccl (a clear error instead of host collectives on spyre
tensors).
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from torch_spyre.distributed import BACKEND


class SpyreCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group, device=None, device_group=None, unique_name="", **kw) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, **kw)
        if device_group is not None and self.world_size > 1:
            name = device_group.name() if hasattr(device_group, "name") else ""
            backend = torch.distributed.get_backend(device_group)
            if BACKEND not in str(backend):
                raise RuntimeError(
                    f"spyre: vLLM group {unique_name!r} {name} uses torch.distributed backend "
                    f"{backend!r}, not {BACKEND!r}; the spyre platform sets dist_backend="
                    f"{BACKEND!r} (was it overridden?)"
                )
        self.card = torch.device("spyre", torch.spyre.current_device())

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        tensor = torch.empty(size, dtype=dtype, device=self.card)
        torch.distributed.recv(tensor, self.ranks[src], self.device_group)
        return tensor
