"""Shared helpers for the simulator tests: host tensors <-> device buffers."""

from __future__ import annotations

import torch

from torch_spyre.ir import Program


def device_buffers(program: Program, **host: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device-layout tensors for every operand (given ones converted, others zero)."""
    out = {}
    for o in program.operands:
        if o.name in host:
            out[o.name] = o.layout.to_device(host[o.name])
        else:
            out[o.name] = torch.zeros(o.layout.device_size, dtype=o.layout.dtype)
    return out


def host_value(
    program: Program, buffers: dict[str, torch.Tensor], name: str = "out"
) -> torch.Tensor:
    return program.operand(name).layout.to_host(buffers[name])
