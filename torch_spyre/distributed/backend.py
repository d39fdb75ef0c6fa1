"""``spyreccl``: the c10d backend for spyre tensors (docs/distributed.md).

One rank per process, each on its own card (the card of the tensors it
passes).  A collective reads each rank's tensor from its card's device memory
(``runtime.access``), carries the bytes to the peers (transport.py: over the
group's store, which is how the simulation moves them), combines them in rank
order (deterministic: the same bits on every rank and every run) and writes
the result into the spyre tensors' device memory through the runtime's
writers (the simulator's cached host views are invalidated there).  Every
collective then moves each card's modelled clock to when the last card
arrived plus the interconnect model's time (sim/interconnect.py).

PyTorch's public pattern for a backend written in Python is a
``ProcessGroup`` subclass returned by the creator given to
``Backend.register_backend``; c10d then uses it as the whole group, so host
(CPU) tensors passed to the same group go to a gloo backend it owns.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from torch_spyre import settings
from torch_spyre.distributed.transport import (
    Message,
    SpyreCCLError,
    StoreTransport,
    bytes_tensor,
    tensor_bytes,
)
from torch_spyre.runtime import access, cards
from torch_spyre.sim.interconnect import collective_time

R = dist.ReduceOp.RedOpType
_FLOAT16 = (torch.float16, torch.bfloat16)


def _done(result) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _spyre(tensors: list[torch.Tensor]) -> bool:
    kinds = {t.device.type for t in tensors}
    if kinds == {"spyre"}:
        return True
    if "spyre" in kinds:
        raise SpyreCCLError(
            f"spyreccl: a collective got tensors on {sorted(kinds)}; pass all of them on "
            f"the rank's spyre card or all on the host"
        )
    return False


def _desc(h: dict) -> str:
    return f"{h['op']} of {h['dtype']}{list(h['shape'])}" + (
        f" with {h['reduce']}" if h.get("reduce") else ""
    )


class SpyreCCL(dist.ProcessGroup):
    """A c10d process group over spyre cards, one per rank."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        override = settings.get().ccl_timeout_s
        if override:
            timeout = timedelta(seconds=override)
        self._store = store
        self._timeout = timeout
        self._net = StoreTransport(dist.PrefixStore("spyreccl/", store), rank, size, timeout)
        self._host_pg: dist.ProcessGroup | None = None

    def getBackendName(self) -> str:
        return "spyreccl"

    # c10d names a group through its backends; a Python group keeps its own
    # (destroy_process_group unregisters by this name)
    _name = ""
    _desc = ""

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return f"SpyreCCL(rank={self.rank()}, size={self.size()})"

    # --------------------------------------------------------------- host
    def _host(self):
        """gloo for host tensors on this group (made on the first host collective:
        every rank reaches it at the same collective)."""
        if self._host_pg is None:
            self._host_pg = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", self._store), self.rank(), self.size(), self._timeout
            )
        return self._host_pg

    # ------------------------------------------------------------ helpers
    def _header(self, op: str, t: torch.Tensor | None, **extra) -> dict:
        h = {"op": op, "clock": cards.card(t.device.index).clock_s if t is not None else 0.0}
        if t is not None:
            h.update(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        h.update(extra)
        return h

    def _exchange(self, op: str, mine: dict, outgoing: dict[int, bytes]) -> dict[int, Message]:
        msgs = self._net.exchange(
            op, {d: Message(mine, outgoing.get(d, b"")) for d in range(self.size())}
        )
        for src, m in msgs.items():
            if m.header["op"] != mine["op"]:
                raise SpyreCCLError(
                    f"spyreccl: rank {self.rank()} called {_desc(mine)} while rank {src} called "
                    f"{_desc(m.header)}; every rank must call the same collectives in order"
                )
        return msgs

    def _check_same(self, mine: dict, msgs: dict[int, Message], keys=("shape", "dtype")) -> None:
        bad = {s: m.header for s, m in msgs.items() if any(m.header[k] != mine[k] for k in keys)}
        if bad:
            theirs = "; ".join(f"rank {s}: {_desc(h)}" for s, h in sorted(bad.items()))
            raise SpyreCCLError(
                f"spyreccl {mine['op']}: rank {self.rank()} passed {_desc(mine)} but {theirs}; "
                f"every rank must pass tensors of the same shape and dtype"
            )

    def _clock(self, op: str, t: torch.Tensor, nbytes: int, msgs: dict[int, Message]) -> None:
        """Every card waits for the last to arrive, then the collective's time."""
        idx = t.device.index
        start = max([cards.card(idx).clock_s] + [m.header["clock"] for m in msgs.values()])
        cards.record_collective(
            idx, op, nbytes, collective_time(op, nbytes, self.size(), cards.config(idx)), start
        )

    def _parts(self, mine: torch.Tensor, msgs: dict[int, Message]) -> list[torch.Tensor]:
        """Every rank's values, in rank order."""
        shape, dtype = list(mine.shape), mine.dtype
        return [
            mine if r == self.rank() else bytes_tensor(msgs[r].payload, dtype, shape)
            for r in range(self.size())
        ]

    def _reduce(self, parts: list[torch.Tensor], op: dist.ReduceOp) -> torch.Tensor:
        kind = op.op if hasattr(op, "op") else op
        dtype = parts[0].dtype
        if kind == R.PREMUL_SUM:
            raise SpyreCCLError("spyreccl: PREMUL_SUM is not supported; scale, then SUM")
        if kind == R.AVG and not dtype.is_floating_point:
            raise SpyreCCLError(f"spyreccl: AVG of {dtype} tensors; use SUM and divide")
        if kind in (R.BAND, R.BOR, R.BXOR) and dtype.is_floating_point:
            raise SpyreCCLError(f"spyreccl: bitwise {kind.name} of {dtype} tensors")
        # 16-bit floats combine in fp32, rounded once at the end (fixed rank order)
        acc = parts[0].to(torch.float32 if dtype in _FLOAT16 else dtype).clone()
        fn = {
            R.SUM: torch.add,
            R.AVG: torch.add,
            R.PRODUCT: torch.mul,
            R.MIN: torch.minimum,
            R.MAX: torch.maximum,
            R.BAND: torch.bitwise_and,
            R.BOR: torch.bitwise_or,
            R.BXOR: torch.bitwise_xor,
        }[kind]
        for p in parts[1:]:
            acc = fn(acc, p.to(acc.dtype))
        if kind == R.AVG:
            acc = acc / len(parts)
        return acc.to(dtype)

    # -------------------------------------------------------- collectives
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        if not _spyre(tensors):
            return self._host().allreduce(tensors, opts)
        for t in tensors:
            vals = access.read(t)
            mine = self._header("all_reduce", t, reduce=opts.reduceOp.op.name)
            msgs = self._exchange(
                "all_reduce", mine, dict.fromkeys(range(self.size()), tensor_bytes(vals))
            )
            self._check_same(mine, msgs, ("shape", "dtype", "reduce"))
            access.write(t, self._reduce(self._parts(vals, msgs), opts.reduceOp))
            self._clock("all_reduce", t, access.device_nbytes(t), msgs)
        return _done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        if not _spyre(input_tensors + [o for outs in output_tensors for o in outs]):
            return self._host().allgather(output_tensors, input_tensors, opts)
        for outs, t in zip(output_tensors, input_tensors):
            if len(outs) != self.size() or any(o.shape != t.shape for o in outs):
                raise SpyreCCLError(
                    f"spyreccl all_gather: needs {self.size()} output tensors of shape "
                    f"{list(t.shape)}, got {[list(o.shape) for o in outs]}"
                )
            parts = self._gather_parts("all_gather", t)
            for o, p in zip(outs, parts):
                access.write(o, p)
        return _done(output_tensors)

    def _gather_parts(self, op: str, t: torch.Tensor) -> list[torch.Tensor]:
        vals = access.read(t)
        mine = self._header(op, t)
        msgs = self._exchange(op, mine, dict.fromkeys(range(self.size()), tensor_bytes(vals)))
        self._check_same(mine, msgs)
        self._clock(op, t, self.size() * access.device_nbytes(t), msgs)
        return self._parts(vals, msgs)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        if not _spyre([output, input]):
            return self._host()._allgather_base(output, input, opts)
        if output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise SpyreCCLError(
                f"spyreccl all_gather_into_tensor: output {output.dtype}{list(output.shape)} must "
                f"hold {self.size()} x the input {input.dtype}{list(input.shape)}"
            )
        parts = self._gather_parts("all_gather", input)
        access.write(output, torch.cat([p.reshape(-1) for p in parts]).reshape(output.shape))
        return _done([output])

    def all_gather_single(self, output, input, opts=None):
        """torch >= 2.13 spells all_gather_into_tensor this way."""
        opts = opts or dist.AllgatherOptions()
        if not _spyre([output, input]):
            return self._host()._allgather_base(output, input, opts)
        return self._allgather_base(output, input, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        flat = output_tensors + [i for ins in input_tensors for i in ins]
        if not _spyre(flat):
            return self._host().reduce_scatter(output_tensors, input_tensors, opts)
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self.size() or any(i.shape != out.shape for i in ins):
                raise SpyreCCLError(
                    f"spyreccl reduce_scatter: needs {self.size()} input tensors of the output's "
                    f"shape {list(out.shape)}, got {[list(i.shape) for i in ins]}"
                )
            chunks = [access.read(i) for i in ins]
            self._reduce_scatter(out, chunks, opts, sum(access.device_nbytes(i) for i in ins))
        return _done(output_tensors)

    def _reduce_scatter(self, out, chunks, opts, nbytes: int) -> None:
        mine = self._header("reduce_scatter", out, reduce=opts.reduceOp.op.name)
        msgs = self._exchange(
            "reduce_scatter", mine, {d: tensor_bytes(chunks[d]) for d in range(self.size())}
        )
        self._check_same(mine, msgs, ("shape", "dtype", "reduce"))
        access.write(out, self._reduce(self._parts(chunks[self.rank()], msgs), opts.reduceOp))
        self._clock("reduce_scatter", out, nbytes, msgs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if not _spyre([output, input]):
            return self._host()._reduce_scatter_base(output, input, opts)
        if input.numel() != self.size() * output.numel() or output.dtype != input.dtype:
            raise SpyreCCLError(
                f"spyreccl reduce_scatter_tensor: input {input.dtype}{list(input.shape)} must "
                f"hold {self.size()} x the output {output.dtype}{list(output.shape)}"
            )
        chunks = list(
            access.read(input)
            .reshape(self.size(), -1)
            .reshape([self.size(), *output.shape])
            .unbind(0)
        )
        self._reduce_scatter(output, chunks, opts, access.device_nbytes(input))
        return _done([output])

    def reduce_scatter_single(self, output, input, opts=None):
        """torch >= 2.13 spells reduce_scatter_tensor this way."""
        opts = opts or dist.ReduceScatterOptions()
        if not _spyre([output, input]):
            return self._host()._reduce_scatter_base(output, input, opts)
        return self._reduce_scatter_base(output, input, opts)

    def reduce(self, tensors, opts=None):
        """dist.reduce: an all_reduce whose result only the root keeps (same model)."""
        opts = opts or dist.ReduceOptions()
        if not _spyre(tensors):
            return self._host().reduce(tensors, opts)
        for t in tensors:
            vals = access.read(t)
            mine = self._header("reduce", t, reduce=opts.reduceOp.op.name, root=opts.rootRank)
            msgs = self._exchange("reduce", mine, {opts.rootRank: tensor_bytes(vals)})
            self._check_same(mine, msgs, ("shape", "dtype", "reduce", "root"))
            if self.rank() == opts.rootRank:
                access.write(t, self._reduce(self._parts(vals, msgs), opts.reduceOp))
            self._clock("all_reduce", t, access.device_nbytes(t), msgs)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        if not _spyre(tensors):
            return self._host().broadcast(tensors, opts)
        root = opts.rootRank
        for t in tensors:
            is_root = self.rank() == root
            payload = tensor_bytes(access.read(t)) if is_root else b""
            mine = self._header("broadcast", t, root=root)
            msgs = self._exchange("broadcast", mine, dict.fromkeys(range(self.size()), payload))
            self._check_same(mine, msgs, ("shape", "dtype", "root"))
            if not is_root:
                access.write(t, bytes_tensor(msgs[root].payload, t.dtype, list(t.shape)))
            self._clock("broadcast", t, access.device_nbytes(t), msgs)
        return _done(tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        flat = input_tensors + [o for outs in output_tensors for o in outs]
        if not _spyre(flat):
            return self._host().gather(output_tensors, input_tensors, opts)
        root, t = opts.rootRank, input_tensors[0]
        vals = access.read(t)
        mine = self._header("gather", t, root=root)
        msgs = self._exchange("gather", mine, {root: tensor_bytes(vals)})
        self._check_same(mine, msgs, ("shape", "dtype", "root"))
        if self.rank() == root:
            outs = output_tensors[0]
            if len(outs) != self.size():
                raise SpyreCCLError(
                    f"spyreccl gather: the root needs {self.size()} output tensors, got {len(outs)}"
                )
            for o, p in zip(outs, self._parts(vals, msgs)):
                access.write(o, p)
        self._clock("gather", t, self.size() * access.device_nbytes(t), msgs)
        return _done(output_tensors)

    def barrier(self, opts=None):
        mine = {"op": "barrier", "clock": 0.0}
        dev = self._barrier_card()
        if dev is not None:
            mine["clock"] = cards.card(dev).clock_s
        msgs = self._exchange("barrier", mine, {})
        if dev is not None:
            start = max([mine["clock"]] + [m.header["clock"] for m in msgs.values()])
            t = collective_time("barrier", 0, self.size(), cards.config(dev))
            cards.record_collective(dev, "barrier", 0, t, start)
        return _done([])

    @staticmethod
    def _barrier_card() -> int | None:
        """The card this rank's barrier synchronises: the current spyre device."""
        try:
            return torch.spyre.current_device()
        except Exception:
            return None

    def send(self, tensors, dst, tag=0):
        if not _spyre(tensors):
            return self._host().send(tensors, dst, tag)
        for t in tensors:
            h = self._header("send", t)
            self._net.send(dst, tag, Message(h, tensor_bytes(access.read(t))))
            nbytes = access.device_nbytes(t)
            cfg = cards.config(t.device.index)
            cards.record_collective(
                t.device.index, "send", nbytes, collective_time("send", nbytes, 2, cfg)
            )
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        if not _spyre(tensors):
            return self._host().recv(tensors, src, tag)
        for t in tensors:
            m = self._net.recv(src, tag)
            h = m.header
            if h["shape"] != list(t.shape) or h["dtype"] != str(t.dtype).removeprefix("torch."):
                raise SpyreCCLError(
                    f"spyreccl recv on rank {self.rank()}: rank {src} sent {h['dtype']}"
                    f"{h['shape']} into a {t.dtype}{list(t.shape)} tensor; shapes and dtypes "
                    f"must match"
                )
            access.write(t, bytes_tensor(m.payload, t.dtype, list(t.shape)))
            nbytes = access.device_nbytes(t)
            cfg = cards.config(t.device.index)
            start = max(cards.card(t.device.index).clock_s, h["clock"])
            cards.record_collective(
                t.device.index, "recv", nbytes, collective_time("recv", nbytes, 2, cfg), start
            )
        return _done(tensors)

    def recv_anysource(self, tensors, tag=0):
        if not _spyre(tensors):
            return self._host().recv_anysource(tensors, tag)
        raise SpyreCCLError(
            "spyreccl recv: name the source rank (src=...); any-source is not offered"
        )


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> SpyreCCL:
    """The creator ``Backend.register_backend`` calls."""
    return SpyreCCL(store, rank, size, timeout)
