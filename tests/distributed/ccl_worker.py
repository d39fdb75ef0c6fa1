"""One rank of the spyreccl tests: ``python ccl_worker.py SCENARIO`` under torchrun
(or with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).  Prints ``OK`` last."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_spyre  # noqa: F401
from torch_spyre.runtime import cards
from torch_spyre.sim import trace

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("spyre", rank)
torch.spyre.set_device(rank)
cfg = cards.config(rank)
BW, LAT, n = cfg.c2c_bandwidth_Bps, cfg.c2c_latency_s, world


def expected(op: str, nbytes: int) -> float:
    """The interconnect model of docs/distributed.md, written out independently."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / BW + 2 * (n - 1) * LAT
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / BW + (n - 1) * LAT
    if op == "broadcast":
        return nbytes / BW + (n - 1) * LAT
    if op == "barrier":
        return 2 * (n - 1) * LAT
    return nbytes / BW + LAT  # send / recv


records: list = []
trace.add_listener(lambda r: records.append(r) if getattr(r, "kind", "") == "c2c" else None)


def check_clock(op: str, nbytes: int, before: float, after: float) -> None:
    """The collective's modelled time is the formula, and the card's clock moved by
    it (plus the wait for later cards, none when all start together)."""
    rec = records[-1]
    assert rec.label == op and rec.nbytes == nbytes, (rec, op, nbytes)
    assert rec.time_s == expected(op, nbytes), (op, rec.time_s, expected(op, nbytes))
    wait = rec.start_s - before
    assert wait >= 0 and abs((after - before) - wait - rec.time_s) < 1e-15, (after, before, rec)


def data(shape, dtype, salt=0) -> torch.Tensor:
    # small integers: every reduction order gives the same bits
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def collectives() -> None:
    """Every collective on spyre tensors against gloo on the same CPU tensors."""
    clock = lambda: cards.card(rank).clock_s  # noqa: E731
    for dtype in (torch.float16, torch.float32):
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
            red = getattr(dist.ReduceOp, op)
            host = data((6, 70), dtype, salt=1)
            if op == "AVG":  # gloo has no AVG: reference is SUM / n
                ref = host.clone()
                dist.all_reduce(ref)
                ref = (ref.float() / n).to(dtype)
            else:
                ref = host.clone()
                dist.all_reduce(ref, op=red)
            x = host.to(dev)
            t0 = clock()
            dist.all_reduce(x, op=red)
            t1 = clock()
            assert torch.equal(x.cpu(), ref), (op, dtype, x.cpu(), ref)
            # [6, 70] in sticks: 2 sticks a row (70 of 64 per fp16 stick, 32 per fp32)
            sticks = 6 * (2 if dtype == torch.float16 else 3)
            check_clock("all_reduce", sticks * 128, t0, t1)
        # all_gather (list) and into one tensor
        host = data((3, 64), dtype, salt=2)
        ref = [torch.empty_like(host) for _ in range(n)]
        dist.all_gather(ref, host)
        outs = [torch.empty(3, 64, dtype=dtype, device=dev) for _ in range(n)]
        t0 = clock()
        dist.all_gather(outs, host.to(dev))
        t1 = clock()
        assert all(torch.equal(o.cpu(), r) for o, r in zip(outs, ref))
        nb = 3 * 64 * host.element_size()  # whole sticks: 64 fp16 or fp32 elements a row
        check_clock("all_gather", n * max(nb, 128), t0, t1)
        big = torch.empty(n * 3, 64, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(big, host.to(dev))
        assert torch.equal(big.cpu(), torch.cat(ref))
        # reduce_scatter (list) and from one tensor
        ins = [data((2, 64), dtype, salt=10 + d) for d in range(n)]
        ref = torch.empty(2, 64, dtype=dtype)
        dist.reduce_scatter(ref, [i.clone() for i in ins])
        out = torch.empty(2, 64, dtype=dtype, device=dev)
        t0 = clock()
        dist.reduce_scatter(out, [i.to(dev) for i in ins])
        t1 = clock()
        assert torch.equal(out.cpu(), ref)
        check_clock("reduce_scatter", n * 2 * 64 * host.element_size(), t0, t1)
        flat = torch.cat(ins)
        out2 = torch.empty(2, 64, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out2, flat.to(dev))
        assert torch.equal(out2.cpu(), ref)
        # broadcast from the last rank
        host = data((5, 64), dtype, salt=3)
        ref = host.clone()
        dist.broadcast(ref, src=n - 1)
        x = host.to(dev)
        t0 = clock()
        dist.broadcast(x, src=n - 1)
        t1 = clock()
        assert torch.equal(x.cpu(), ref)
        check_clock("broadcast", 5 * 64 * host.element_size(), t0, t1)
    # send / recv around the ring
    x = data((4, 64), torch.float16, salt=4).to(dev)
    y = torch.empty(4, 64, dtype=torch.float16, device=dev)
    src, dst = (rank - 1) % n, (rank + 1) % n
    if rank % 2 == 0:
        dist.send(x, dst)
        dist.recv(y, src)
    else:
        dist.recv(y, src)
        dist.send(x, dst)
    g = torch.Generator().manual_seed(1000 * src + 4)
    assert torch.equal(y.cpu(), torch.randint(-8, 9, (4, 64), generator=g).to(torch.float16))
    assert records[-1].time_s == expected(records[-1].label, 4 * 64 * 2)
    # barrier: every card's clock ends at the same modelled time
    t0 = clock()
    dist.barrier()
    t1 = clock()
    check_clock("barrier", 0, t0, t1)
    clocks = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(clocks, torch.tensor([clock()], dtype=torch.float64))
    assert len({c.item() for c in clocks}) == 1, clocks


def skew() -> None:
    """A card that arrives late: the others wait for it, then all finish together."""
    if rank == 1:
        cards.card(rank).record_transfer("h2d", 10_000_000)  # ~159 us of modelled PCIe
    x = data((1, 64), torch.float32).to(dev)
    before = cards.card(rank).clock_s
    dist.all_reduce(x)
    rec = records[-1]
    clocks = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(clocks, torch.tensor([cards.card(rank).clock_s], dtype=torch.float64))
    assert len({c.item() for c in clocks}) == 1, clocks
    assert rec.time_s == expected("all_reduce", 256)
    waited = cards.card(rank).stats()["collective_wait_s"]
    if rank == 1:
        assert waited == 0.0
    else:
        assert waited > 150e-6 and rec.start_s > before, (waited, rec, before)


def mismatch() -> None:
    x = torch.zeros(4 + rank, 64, dtype=torch.float16, device=dev)
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        msg = str(e)
        assert "same shape" in msg and "[4, 64]" in msg and "[5, 64]" in msg, msg
        print("ERR", msg)
    else:
        raise AssertionError("mismatched shapes were not reported")
    y = torch.zeros(4, 64, dtype=torch.float16 if rank == 0 else torch.float32, device=dev)
    try:
        dist.all_reduce(y)
    except RuntimeError as e:
        assert "float16" in str(e) and "float32" in str(e), str(e)
    else:
        raise AssertionError("mismatched dtypes were not reported")


def dead_peer() -> None:
    if rank == n - 1:
        os._exit(0)  # dies before the collective
    x = torch.zeros(4, 64, device=dev)
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except TimeoutError as e:
        took = time.monotonic() - t0
        assert f"rank(s) {n - 1} did not take part" in str(e), str(e)
        assert took < 10, took
        print("ERR", e)
    else:
        raise AssertionError("a dead peer was not reported")


if __name__ == "__main__":
    scenario = sys.argv[1]
    timeout = timedelta(seconds=float(os.environ.get("CCL_TEST_TIMEOUT", "30")))
    dist.init_process_group("cpu:gloo,spyre:spyreccl", timeout=timeout)
    # one gloo collective first: every rank has finished connecting gloo's mesh
    # before any scenario runs (a rank done early must not exit while a slower
    # one, on a loaded machine, is still mid-handshake: "connectFullMesh failed")
    dist.all_reduce(torch.zeros(1))
    globals()[scenario]()
    print("OK", flush=True)
    if scenario != "dead_peer":
        # rank 0 hosts the store outside torchrun: nobody leaves before all have
        # read their last messages (a host all_reduce, over the group's gloo)
        dist.all_reduce(torch.zeros(1))
        dist.destroy_process_group()
    os._exit(0)
