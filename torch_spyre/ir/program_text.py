"""A kernel program as text (``dump``) and as JSON (``to_json`` / ``from_json``)."""

from __future__ import annotations

import json
from typing import Any, Self

import torch

from torch_spyre.ir.steps import (
    _STEP_TYPES,
    Buffer,
    Dim,
    Load,
    Matmul,
    Operand,
    ProgramError,
    Reduce,
    Scan,
    Step,
    Store,
    Vector,
    _fmt_bytes,
)
from torch_spyre.layout import SpyreTensorLayout


class ProgramText:
    """``Program``'s text and JSON forms (a mixin: the fields are ``Program``'s)."""

    def dump(self) -> str:
        grid = " x ".join(f"{d.name}:{d.cores}" for d in self.grid) or "1"
        out = [f"kernel {self.name}  cores {self.cores_used} (grid {grid})"]
        out.append(
            "  dims     "
            + ", ".join(
                f"{d.name}={d.size}"
                + (f"/{d.cores}" if d.cores > 1 else "")
                + f" tile {d.tile_size}"
                + (f" (causal to {d.causal_to})" if d.causal_to else "")
                for d in self.dims
            )
        )
        for o in self.operands:
            lay = o.layout
            out.append(
                f"  {o.role:<8} {o.name}: {list(lay.host_size)} {str(lay.dtype).removeprefix('torch.')}"
                f" device {list(lay.device_size)} stride_map {list(lay.stride_map)}"
            )
        usage = self.lx_usage()
        for b in self.buffers:
            ext = self.buffer_extents(b.name)
            out.append(
                f"  lx       {b.name}[{', '.join(f'{d}:{ext[d]}' for d in b.dims)}] "
                f"{str(b.dtype).removeprefix('torch.')}{' x2' if b.double_buffered else ''}"
                f" = {_fmt_bytes(usage[b.name])}"
            )
        out.append(f"  lx total {_fmt_bytes(sum(usage.values()))} per core")
        opened: tuple[str, ...] = ()
        for s in self.steps:
            loops = tuple(s.loops)
            keep = 0
            while keep < min(len(opened), len(loops)) and opened[keep] == loops[keep]:
                keep += 1
            while len(opened) > keep:
                opened = opened[:-1]
                out.append("  " + "  " * len(opened) + "end")
            while len(opened) < len(loops):
                d = self.dim(loops[len(opened)])
                out.append("  " + "  " * len(opened) + f"for {d.name} in tiles of {d.tile_size}:")
                opened += (d.name,)
            out.append("  " + "  " * len(opened) + "  " + _step_text(s))
        while opened:
            opened = opened[:-1]
            out.append("  " + "  " * len(opened) + "end")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.dump()

    # --------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dims": [d.__dict__ for d in self.dims],
            "operands": [
                {
                    "name": o.name,
                    "role": o.role,
                    "host_size": list(o.layout.host_size),
                    "device_size": list(o.layout.device_size),
                    "dim_map": list(o.layout.dim_map),
                    "dtype": _dtype_name(o.layout.dtype),
                }
                for o in self.operands
            ],
            "buffers": [
                {
                    "name": b.name,
                    "dims": list(b.dims),
                    "dtype": _dtype_name(b.dtype),
                    "double_buffered": b.double_buffered,
                }
                for b in self.buffers
            ],
            "steps": [_step_dict(s) for s in self.steps],
            "loop_order": list(self.loop_order),
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        try:
            return cls(
                name=d["name"],
                dims=tuple(Dim(**x) for x in d["dims"]),
                operands=tuple(
                    Operand(
                        x["name"],
                        SpyreTensorLayout(
                            tuple(x["host_size"]),
                            tuple(x["device_size"]),
                            tuple(x["dim_map"]),
                            _dtype(x["dtype"]),
                        ),
                        x["role"],
                    )
                    for x in d["operands"]
                ),
                buffers=tuple(
                    Buffer(x["name"], tuple(x["dims"]), _dtype(x["dtype"]), x["double_buffered"])
                    for x in d["buffers"]
                ),
                steps=tuple(_step_from_dict(x) for x in d["steps"]),
                loop_order=tuple(d.get("loop_order", ())),
                meta=dict(d.get("meta", {})),
            )
        except (KeyError, TypeError) as e:
            raise ProgramError(f"malformed kernel program JSON: {e!r}") from None

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text))


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ProgramError(f"unknown dtype {name!r}")
    return dt


def _step_dict(s: Step) -> dict[str, Any]:
    d = dict(s.__dict__)
    for k, v in d.items():
        if isinstance(v, tuple):
            d[k] = list(v)
    return d


def _step_from_dict(d: dict[str, Any]) -> Step:
    d = dict(d)
    cls = _STEP_TYPES.get(d.pop("kind", None))
    if cls is None:
        raise ProgramError(f"unknown step kind in {d}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _idx(index: tuple[str | None, ...], s: Load | Store | None = None) -> str:
    names = [d if d is not None else "0" for d in index]
    if s is not None and s.rows:  # paged: that dim's rows come from the table
        names[s.rows_dim] = f"{s.rows}[{names[s.rows_dim]}]"
    return ", ".join(names)


def _step_text(s: Step) -> str:
    if isinstance(s, Load):
        mc = "   (multicast over the ring)" if s.multicast else ""
        at = f" from {list(s.offsets)}" if any(s.offsets) else ""
        return f"load   {s.buffer} <- {s.operand}[{_idx(s.index, s)}]{at}{mc}"
    if isinstance(s, Store):
        at = f" at {list(s.offsets)}" if any(s.offsets) else ""
        return f"store  {s.operand}[{_idx(s.index, s)}]{at} <- {s.buffer}"
    if isinstance(s, Matmul):
        return f"matmul {s.out} += {s.a} @ {s.b}   (PE array)"
    if isinstance(s, Vector):
        args = list(s.inputs) + [repr(x) for x in s.scalars]
        along = f", along {s.dim}" if s.dim else ""
        return f"vector {s.out} = {s.op}({', '.join(args)}{along})"
    if isinstance(s, Reduce):
        return f"reduce {s.out} = {s.op}({s.input}, over {s.dim})"
    if isinstance(s, Scan):
        return f"scan   {s.out} = {s.op}({', '.join(s.inputs)}, along {s.dim})   (sequential)"
    return f"ring   allreduce-{s.op} {s.buffer} over cores splitting {s.dim}"
