"""Collectives between spyre cards: the ``spyreccl`` c10d backend (docs/distributed.md).

``import torch_spyre`` registers it; then
``torch.distributed.init_process_group("cpu:gloo,spyre:spyreccl")`` (or just
``"spyreccl"``) under ``torchrun`` runs collectives on spyre tensors, one card
per process.
"""

from __future__ import annotations

import torch.distributed as dist

BACKEND = "spyreccl"


def register() -> None:
    """Register ``spyreccl`` with torch.distributed (once per process)."""
    if not dist.is_available() or hasattr(dist.Backend, BACKEND.upper()):
        return
    from torch_spyre.distributed.backend import create

    dist.Backend.register_backend(BACKEND, create, devices=["spyre"])


__all__ = ["BACKEND", "register"]
