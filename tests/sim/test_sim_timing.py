"""The timing model behaves physically and deterministically."""

import json
import subprocess
import sys

import pytest
import torch

from torch_spyre import kernels as K
from torch_spyre.hardware import HardwareConfig
from torch_spyre.sim import estimate

CFG = HardwareConfig()


def _mem_s(rep):
    """Seconds the slowest core's DMA engine spends moving bytes (setup excluded)."""
    return rep.dram_bytes / CFG.sustained_bandwidth_Bps


def test_twice_the_data_takes_twice_the_memory_time():
    small = estimate(K.elementwise("add", (4096, 8192)))
    big = estimate(K.elementwise("add", (8192, 8192)))
    assert small.bottleneck == big.bottleneck == "memory"
    assert big.dram_bytes == 2 * small.dram_bytes
    ratio = max(big.busy_s["dma"]) / max(small.busy_s["dma"])
    assert ratio == pytest.approx(2.0, rel=0.01)
    # end to end, launch and pipeline fill are the only fixed parts
    assert (big.time_s - big.launch_s) / (small.time_s - small.launch_s) == pytest.approx(
        2.0, rel=0.02
    )


@pytest.mark.parametrize("eff", [CFG.dram_efficiency, 1.0])
def test_memory_bound_kernels_sit_on_the_bandwidth_roof(eff):
    cfg = CFG.replace(dram_efficiency=eff)
    for p in (K.elementwise("add", (8192, 8192)), K.softmax(4096, 2048, cores=32)):
        rep = estimate(p, cfg)
        assert rep.bottleneck == "memory"
        sustained_roof = rep.compulsory_bytes / cfg.sustained_bandwidth_Bps
        # within 3% of the sustained-bandwidth roof ...
        assert rep.time_s == pytest.approx(sustained_roof, rel=0.03)
        # ... which is the card's roofline scaled by the sustained fraction
        assert rep.attainment == pytest.approx(eff, rel=0.03)


def test_32_cores_beat_1_core_by_the_predicted_factor():
    # the model's prediction is max(compute / cores, memory) plus fixed
    # costs.  softmax: one core nearly balances its SFU work against the
    # LPDDR5 it can use alone (so 32 cores gain little); memory bound on 32
    one = estimate(K.softmax(4096, 2048, cores=1))
    many = estimate(K.softmax(4096, 2048, cores=32))
    assert many.bottleneck == "memory"
    compute1 = one.busy_s["vector"][0]
    assert max(many.busy_s["vector"]) == pytest.approx(compute1 / 32, rel=0.01)
    dma1, dma32 = one.busy_s["dma"][0], max(many.busy_s["dma"])
    # every core streams at 1/32 of the shared bandwidth: about the same DMA
    # time (one core issues more, smaller transfers: more set-up cycles)
    assert dma32 == pytest.approx(dma1, rel=0.06)
    predicted = (one.launch_s + max(compute1, dma1)) / (many.launch_s + max(compute1 / 32, dma32))
    assert one.time_s / many.time_s == pytest.approx(predicted, rel=0.03)
    # a large matmul: compute bound on 1 core, PE work splits 32 ways
    one = estimate(K.matmul(4096, 4096, 4096, split=(1, 1, 1)))
    many = estimate(K.matmul(4096, 4096, 4096))
    assert one.bottleneck == "compute"
    assert max(many.busy_s["pe"]) == pytest.approx(one.busy_s["pe"][0] / 32, rel=0.01)
    speedup = one.time_s / many.time_s
    # on 32 cores the shared LPDDR5 (multicast operands) just exceeds the PE time
    bound = max(max(many.busy_s[u]) for u in ("pe", "dma", "ring"))
    assert many.bottleneck == "memory" and bound > max(many.busy_s["pe"])
    assert speedup == pytest.approx(one.time_s / (many.launch_s + bound), rel=0.03)
    assert 20 < speedup <= 32


def test_compute_bound_matmul_near_peak_on_one_core():
    rep = estimate(K.matmul(2048, 2048, 2048, split=(1, 1, 1)))
    assert rep.bottleneck == "compute"
    assert rep.flops == 2 * 2048**3
    # the PE array at full occupancy: 1024 MAC/cycle/core
    assert rep.busy_s["pe"][0] == pytest.approx(2048**3 / 1024 / CFG.clock_hz, rel=0.01)
    assert rep.utilisation > 0.9


def test_small_kernels_are_overhead_bound():
    rep = estimate(K.elementwise("add", (8, 64)))
    assert rep.bottleneck == "overhead"
    assert rep.time_s >= CFG.launch_overhead_s


def test_ring_allreduce_cost():
    p = K.ring_allreduce(32, 32 * 1024, tile=32 * 1024)
    rep = estimate(p)
    nbytes = 32 * 1024 * 4
    sent = 2 * 31 / 32 * nbytes
    assert rep.ring_bytes == pytest.approx(32 * sent)
    cycles = sent / (2 * CFG.ring_bytes_per_cycle) + 2 * 31 * CFG.ring_hop_cycles
    assert rep.busy_s["ring"][0] == pytest.approx(cycles / CFG.clock_hz)


def test_more_cores_or_lx_in_design_studies():
    p = K.softmax(4096, 2048, cores=16)
    assert p.cores_used == 16
    half = CFG.replace(cores=16)
    assert estimate(p, half).time_s == pytest.approx(estimate(p).time_s)
    # the roofline follows the configured card
    assert estimate(K.matmul(1024, 1024, 1024), half).roofline_time_s > 0


def test_double_buffering_overlaps_dma_and_compute():
    fast = estimate(K.matmul(2048, 2048, 2048, double_buffer=True))
    slow = estimate(K.matmul(2048, 2048, 2048, double_buffer=False))
    assert slow.time_s > fast.time_s
    b = {u: max(v) for u, v in slow.busy_s.items()}
    assert slow.time_s == pytest.approx(slow.launch_s + b["dma"] + b["pe"] + b["ring"], rel=0.02)


_SCRIPT = """
import json
from torch_spyre.sim import estimate
from torch_spyre import kernels as K
progs = [K.elementwise("add", (300, 200)), K.matmul(512, 4096, 4096), K.softmax(4096, 2048),
         K.rmsnorm(128, 4096), K.ring_allreduce(8, 4096), K.gemv(4096, 25600, cores=25)]
print(json.dumps([[estimate(p).cycles, estimate(p).time_s, estimate(p).dram_bytes] for p in progs]))
"""


def test_deterministic_across_runs_and_processes():
    runs = [
        subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    a, b = (json.loads(r.stdout) for r in runs)
    assert a == b
    p = K.matmul(512, 4096, 4096)
    assert estimate(p) == estimate(p)


def test_bigger_tiles_move_fewer_bytes():
    small = estimate(
        K.matmul(2048, 2048, 2048, split=(4, 8, 1), tiles=(64, 64, 128), multicast=False)
    )
    big = estimate(
        K.matmul(2048, 2048, 2048, split=(4, 8, 1), tiles=(256, 256, 128), multicast=False)
    )
    assert big.dram_bytes < small.dram_bytes and big.time_s < small.time_s
    assert torch.float16  # keep the import used


def test_best_matmul_is_no_slower_than_the_default_split():
    for m, n, k in [(4096, 4096, 4096), (64, 64, 32768), (256, 384, 512)]:
        best = estimate(K.best_matmul(m, n, k))
        assert best.time_s <= estimate(K.matmul(m, n, k)).time_s * (1 + 1e-9)
    # a deep-K problem is best split over K, with a ring all-reduce
    p = K.best_matmul(64, 64, 32768)
    assert p.dim("k").cores > 1 and any(s.kind == "allreduce" for s in p.steps)


def test_compulsory_bytes_count_the_blocks_a_program_touches():
    """A program that reads one timestep of a sequence operand (``offsets``)
    must move that step's bytes, not the whole sequence's: its roofline does
    not grow with the sequence (kernels/recurrent.py)."""
    from torch_spyre.kernels import recurrent

    reps = [
        estimate(recurrent.recurrent_step("lstm", 8, 64, 64, t, 0, split=(1, 2)), CFG)
        for t in (2, 64)
    ]
    assert reps[0].compulsory_bytes == reps[1].compulsory_bytes
    assert reps[0].roofline_time_s == reps[1].roofline_time_s
    assert reps[1].attainment <= 1.0
    # an operand read whole still counts its padded size
    mm = K.matmul(64, 100, 48)
    assert estimate(mm, CFG).compulsory_bytes == sum(o.layout.nbytes for o in mm.operands)
