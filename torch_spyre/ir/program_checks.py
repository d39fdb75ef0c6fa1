"""Validation of a kernel program against a card: dims, transfers, LX
capacity and each core's addressable span (``Program.validate``)."""

from __future__ import annotations

from typing import Self

import torch

from torch_spyre.hardware import HardwareConfig
from torch_spyre.ir import vector_ops as ops_mod
from torch_spyre.ir.steps import (
    SCANS,
    Load,
    LXOverflowError,
    Matmul,
    ProgramError,
    Reduce,
    RingAllReduce,
    Scan,
    SpanError,
    Store,
    Vector,
    _fmt_bytes,
    step_reads,
    step_writes,
    transfer_dims,
)
from torch_spyre.layout import SpyreTensorLayout


class ProgramChecks:
    """``Program``'s validation (a mixin: the fields are ``Program``'s)."""

    def validate(self, config: HardwareConfig | None = None) -> Self:
        """Raise ``ProgramError`` (or a subclass) if this cannot run on ``config``."""
        cfg = config or HardwareConfig()
        where = f"kernel program {self.name!r}"
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ProgramError(f"{where}: duplicate dim names {names}")
        for d in self.dims:
            if d.size < 1 or d.cores < 1 or (d.tile is not None and d.tile < 1):
                raise ProgramError(f"{where}: dim {d} needs size, cores and tile >= 1")
            if d.cores > d.size:
                raise ProgramError(
                    f"{where}: dim {d.name!r} of size {d.size} split over {d.cores} cores"
                )
            if d.causal_to is not None and (d.causal_to not in names or d.causal_to == d.name):
                raise ProgramError(
                    f"{where}: dim {d.name!r} is causal to {d.causal_to!r}, which is not "
                    "another dim of the program"
                )
            if d.chunk is not None and not (d.cores - 1) * d.chunk < d.size <= d.cores * d.chunk:
                raise ProgramError(
                    f"{where}: dim {d.name!r}: {d.cores} chunks of {d.chunk} do not cover "
                    f"{d.size} elements with every core non-empty"
                )
        if self.cores_used > cfg.cores:
            raise ProgramError(
                f"{where}: core grid {'x'.join(str(d.cores) for d in self.grid)} needs "
                f"{self.cores_used} cores but the card has {cfg.cores}"
            )
        for lname in self.loop_order:
            if lname not in names:
                raise ProgramError(f"{where}: loop over unknown dim {lname!r}")
        for b in self.buffers:
            for d in b.dims:
                if d not in names:
                    raise ProgramError(f"{where}: buffer {b.name!r} indexed by unknown dim {d!r}")
        buffer_names = {b.name for b in self.buffers}
        operand_names = {o.name for o in self.operands}
        # partial (per-core) dims of each buffer's current value, in program order
        partial: dict[str, set[str]] = {}
        written: set[str] = set()
        for i, s in enumerate(self.steps):
            at = f"{where}, step {i} ({s.kind})"
            if not self.nests_in_order(s.loops):
                raise ProgramError(
                    f"{at}: loops {list(s.loops)} are not in the order of {list(self.loop_order)}"
                )
            for r in step_reads(s):
                if r not in buffer_names:
                    raise ProgramError(f"{at}: reads unknown buffer {r!r}")
                if r not in written:
                    raise ProgramError(f"{at}: reads buffer {r!r} before any step writes it")
            w = step_writes(s)
            if w is not None and w not in buffer_names:
                raise ProgramError(f"{at}: writes unknown buffer {w!r}")
            if isinstance(s, Load | Store):
                self._check_transfer(s, at, operand_names)
            if isinstance(s, Store | Vector | Matmul | Scan):
                for r in step_reads(s):
                    if partial.get(r):
                        raise ProgramError(
                            f"{at}: buffer {r!r} holds per-core partial results over "
                            f"{sorted(partial[r])}; combine them with a RingAllReduce first"
                        )
            if isinstance(s, Load):
                partial[s.buffer] = set()
            elif isinstance(s, Vector):
                if s.op not in ops_mod.VECTOR_OPS and not (
                    s.op.endswith(":unary") and ops_mod.aten_unary(s.op[5:-6]) == s.op
                ):
                    raise ProgramError(
                        f"{at}: unknown vector op {s.op!r}; known: {', '.join(sorted(ops_mod.VECTOR_OPS))}"
                        " (add ops with torch_spyre.ir.register_op)"
                    )
                od = ops_mod.VECTOR_OPS[s.op]
                if len(s.inputs) != od.num_inputs:
                    raise ProgramError(f"{at}: op {s.op!r} takes {od.num_inputs} buffer inputs")
                union = set().union(*(self.buffer(x).dims for x in s.inputs))
                if s.op == "rename":
                    self._check_rename(s, at)
                elif s.op == "rotate_half":
                    self._check_rotate_half(s, at)
                # an op without buffer inputs (a fill) writes the whole output buffer
                elif od.num_inputs and union != set(self.buffer(s.out).dims):
                    raise ProgramError(
                        f"{at}: output {s.out!r} dims {self.buffer(s.out).dims} must be the "
                        f"union of the input dims {sorted(union)}"
                    )
                partial[s.out] = set()
            elif isinstance(s, Matmul):
                a, b, o = (set(self.buffer(x).dims) for x in (s.a, s.b, s.out))
                k = (a & b) - o
                if not k or o != (a | b) - k:
                    raise ProgramError(
                        f"{at}: matmul dims out {sorted(o)} = a {sorted(a)} x b {sorted(b)} "
                        "must contract the dims a and b share and out lacks"
                    )
                partial[s.out] = {d for d in k if self.dim(d).cores > 1}
            elif isinstance(s, Reduce):
                if s.op not in ops_mod.REDUCTIONS:
                    raise ProgramError(f"{at}: unknown reduction {s.op!r}")
                src = self.buffer(s.input).dims
                if s.dim not in src or set(self.buffer(s.out).dims) != set(src) - {s.dim}:
                    raise ProgramError(
                        f"{at}: reduce of {s.input!r} {src} over {s.dim!r} must write dims "
                        f"{sorted(set(src) - {s.dim})}, not {self.buffer(s.out).dims}"
                    )
                partial[s.out] = set(partial.get(s.input, set()))
                if self.dim(s.dim).cores > 1:
                    partial[s.out].add(s.dim)
            elif isinstance(s, Scan):
                self._check_scan(s, at)
                partial[s.out] = set()
            elif isinstance(s, RingAllReduce):
                if s.op not in ops_mod.REDUCTIONS:
                    raise ProgramError(f"{at}: unknown reduction {s.op!r}")
                if s.dim not in partial.get(s.buffer, set()):
                    raise ProgramError(
                        f"{at}: buffer {s.buffer!r} holds no per-core partials over "
                        f"{s.dim!r} (dim split over {self.dim(s.dim).cores} cores)"
                    )
                partial[s.buffer] = partial[s.buffer] - {s.dim}
            if w is not None:
                written.add(w)
        for o in self.operands:
            if o.role in ("output", "inout") and not any(
                isinstance(s, Store) and s.operand == o.name for s in self.steps
            ):
                raise ProgramError(f"{where}: output operand {o.name!r} is never stored")
        self._check_lx(cfg, where)
        self._check_span(cfg, where)
        return self

    def _check_scan(self, s: Scan, at: str) -> None:
        if s.op not in SCANS or len(s.inputs) not in SCANS[s.op]:
            raise ProgramError(
                f"{at}: unknown scan {s.op!r} with {len(s.inputs)} inputs; known: "
                + ", ".join(f"{k} ({'/'.join(map(str, v))} inputs)" for k, v in SCANS.items())
            )
        out = set(self.buffer(s.out).dims)
        if s.dim not in out:
            raise ProgramError(f"{at}: scan over {s.dim!r} but {s.out!r} has dims {sorted(out)}")
        if self.dim(s.dim).cores > 1:
            raise ProgramError(
                f"{at}: scan over {s.dim!r}, which is split over {self.dim(s.dim).cores} cores: "
                "a scan walks its dim in order on one core"
            )
        scanned = s.inputs[:2] if s.op == "linrec" else s.inputs
        for x in scanned:
            if not set(self.buffer(x).dims) <= out:
                raise ProgramError(
                    f"{at}: scan input {x!r} dims {self.buffer(x).dims} are not dims of {s.out!r}"
                )
        if len(s.inputs) == 3:
            init = set(self.buffer(s.inputs[2]).dims)
            if s.dim in init or not init <= out:
                raise ProgramError(
                    f"{at}: scan init {s.inputs[2]!r} must have dims of {s.out!r} without {s.dim!r}"
                )

    def _check_rename(self, s: Vector, at: str) -> None:
        """A ``rename``: the output's dims are the input's with one dim
        replaced by another of the same size, neither split over cores."""
        src, out = self.buffer(s.inputs[0]), self.buffer(s.out)
        old, new = set(src.dims) - set(out.dims), set(out.dims) - set(src.dims)
        if len(old) != 1 or len(new) != 1 or src.dtype != out.dtype:
            raise ProgramError(
                f"{at}: rename {s.inputs[0]!r} {src.dims} -> {s.out!r} {out.dims} must swap one "
                "dim for another, dtype kept"
            )
        a, b = self.dim(old.pop()), self.dim(new.pop())
        if a.size != b.size or a.cores > 1 or b.cores > 1:
            raise ProgramError(
                f"{at}: rename of dim {a.name!r} to {b.name!r}: sizes {a.size} and {b.size}, "
                "neither split over cores"
            )

    def _check_rotate_half(self, s: Vector, at: str) -> None:
        """A ``rotate_half``: along ``dim``, a dim of size 2 of its input and
        output (the same dims), not split over cores and not the stick dim."""
        src, out = self.buffer(s.inputs[0]), self.buffer(s.out)
        if (
            s.dim is None
            or src.dims != out.dims
            or s.dim not in out.dims[:-1]
            or self.dim(s.dim).size != 2
            or self.dim(s.dim).cores > 1
        ):
            raise ProgramError(
                f"{at}: rotate_half {s.inputs[0]!r} {src.dims} -> {s.out!r} {out.dims} along "
                f"{s.dim!r} needs the same dims, the rotated one of size 2, on one core, not last"
            )

    def _check_transfer(self, s: Load | Store, at: str, operand_names: set[str]) -> None:
        if s.operand not in operand_names:
            raise ProgramError(f"{at}: unknown operand {s.operand!r}")
        op = self.operand(s.operand)
        if isinstance(s, Store) and op.role == "input":
            raise ProgramError(f"{at}: stores into input operand {op.name!r}")
        lay = op.layout
        if len(s.index) != len(lay.host_size):
            raise ProgramError(
                f"{at}: index {list(s.index)} must name one dim per host dim of "
                f"{op.name!r} {list(lay.host_size)}"
            )
        offsets = getattr(s, "offsets", ())
        if offsets and len(offsets) != len(lay.host_size):
            raise ProgramError(
                f"{at}: offsets {list(offsets)} must give one offset per host dim of "
                f"{op.name!r} {list(lay.host_size)}"
            )
        if s.rows:
            self._check_rows(s, at, lay)
        for k, d in enumerate(s.index):
            off = offsets[k] if offsets else 0
            n = 1 if d is None else self.dim(d).size
            if s.rows and k == s.rows_dim:
                continue  # any row of the operand: checked against the table
            if offsets:
                if off < 0 or off + n > lay.host_size[k]:
                    raise ProgramError(
                        f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]}; "
                        f"reading {n} elements from offset {off} runs past it"
                    )
                if k == lay.stick_dim and off % lay.stick_elems:
                    raise ProgramError(
                        f"{at}: offset {off} into the stick dim of {op.name!r} is not whole "
                        f"sticks of {lay.stick_elems} elements (a DMA cannot shift lanes)"
                    )
            elif d is None:
                if lay.host_size[k] != 1:
                    raise ProgramError(
                        f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]}, not 1"
                    )
            elif self.dim(d).size != lay.host_size[k]:
                raise ProgramError(
                    f"{at}: host dim {k} of {op.name!r} has size {lay.host_size[k]} but "
                    f"dim {d!r} has size {self.dim(d).size}"
                )
        if isinstance(s, Store) and lay.host_size:
            d = s.index[lay.stick_dim]
            if (
                d is not None
                and self.dim(d).cores > 1
                and self.dim(d).core_extent % lay.stick_elems
            ):
                raise ProgramError(
                    f"{at}: dim {d!r} is the stick dim of {op.name!r} and is split over cores "
                    f"in chunks of {self.dim(d).core_extent}, not whole sticks of "
                    f"{lay.stick_elems}: two cores would write the same stick. Set "
                    f"Dim(chunk=...) to a multiple of {lay.stick_elems}."
                )
        idx = list(transfer_dims(self, s))
        if isinstance(s, Load) and s.multicast and not self.multicast_group(s)[0] > 1:
            raise ProgramError(
                f"{at}: multicast load of {op.name!r} but no dim split over cores is "
                f"missing from its index {list(s.index)}: every core needs a different tile"
            )
        buf = self.buffer(s.buffer)
        if sorted(idx) != sorted(buf.dims):
            raise ProgramError(
                f"{at}: operand {op.name!r} indexed by {idx} but buffer {buf.name!r} has dims {list(buf.dims)}"
            )

    def _check_rows(self, s: Load | Store, at: str, lay: SpyreTensorLayout) -> None:
        table = self.buffer(s.rows)
        if table.dtype not in (torch.int32, torch.int64):
            raise ProgramError(f"{at}: row table {s.rows!r} must be int32/int64, not {table.dtype}")
        if not 0 <= s.rows_dim < len(lay.host_size) or s.rows_dim == lay.stick_dim:
            raise ProgramError(
                f"{at}: rows_dim {s.rows_dim} must name a host dim of {s.operand!r} other than "
                f"its stick dim {lay.stick_dim} (a DMA descriptor addresses whole sticks)"
            )
        d = s.index[s.rows_dim]
        if d is None or table.dims[-1] != d:
            raise ProgramError(
                f"{at}: host dim {s.rows_dim} of {s.operand!r} is indexed by {d!r}, which must "
                f"be the last dim of its row table {s.rows!r} {list(table.dims)}"
            )
        if s.rows_run < 1:
            raise ProgramError(f"{at}: rows_run must be >= 1")

    def _check_lx(self, cfg: HardwareConfig, where: str) -> None:
        usage = self.lx_usage(cfg)
        total = sum(usage.values())
        if total > cfg.lx_bytes:
            ext = self.lx_extents()
            detail = ", ".join(
                f"{n} {list(ext[n].values())} {self.buffer(n).dtype}"
                f"{' x2 (double buffered)' if self.buffer(n).double_buffered else ''} = {_fmt_bytes(b)}"
                for n, b in usage.items()
            )
            tiles = ", ".join(f"{d.name}={d.tile_size}" for d in self.dims)
            raise LXOverflowError(
                f"{where} needs {_fmt_bytes(total)} of LX per core but a core has "
                f"{_fmt_bytes(cfg.lx_bytes)}: {detail}. Use smaller tiles (now {tiles}), "
                "split over more cores, or drop double buffering."
            )

    def _check_span(self, cfg: HardwareConfig, where: str) -> None:
        spans = {o.name: self.core_span_bytes(o.name) for o in self.operands}
        total = sum(spans.values())
        if total > cfg.per_core_span_bytes:
            detail = ", ".join(f"{n} {_fmt_bytes(b)}" for n, b in spans.items())
            raise SpanError(
                f"{where}: one core addresses {_fmt_bytes(total)} of device memory ({detail}) "
                f"but a core's span is {_fmt_bytes(cfg.per_core_span_bytes)}. Split the work "
                "over more cores or into several kernels."
            )

    # ------------------------------------------------------------ dumping
