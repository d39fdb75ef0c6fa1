"""Device memory: accounting in whole sticks, peaks, OOM on a small card."""

import gc

import torch


def test_allocated_bytes_return_to_start():
    gc.collect()
    start = torch.spyre.memory_allocated()
    a = torch.empty(1000, 1000, device="spyre")
    # fp32 [1000, 1000] -> device [ceil(1000/32), 1000, 32] = 32 * 1000 * 32 * 4 bytes
    assert torch.spyre.memory_allocated() - start == 32 * 1000 * 32 * 4
    b = a[10:20]  # views hold no memory of their own
    assert torch.spyre.memory_allocated() - start == 32 * 1000 * 32 * 4
    del a, b
    assert torch.spyre.memory_allocated() == start


def test_padding_is_counted():
    start = torch.spyre.memory_allocated()
    t = torch.empty(3, 70, dtype=torch.float16, device="spyre")
    assert torch.spyre.memory_allocated() - start == 2 * 3 * 64 * 2  # 2 sticks per row
    del t


def test_peak_and_reset():
    torch.spyre.reset_peak_memory_stats()
    base = torch.spyre.memory_allocated()
    t = torch.empty(256, 256, device="spyre")
    size = torch.spyre.memory_allocated() - base
    del t
    assert torch.spyre.max_memory_allocated() >= base + size
    torch.spyre.reset_peak_memory_stats()
    assert torch.spyre.max_memory_allocated() == torch.spyre.memory_allocated()


def test_mem_get_info_and_stats():
    free, total = torch.spyre.mem_get_info()
    assert total == torch.spyre.get_device_properties().total_memory
    assert free == total - torch.spyre.memory_allocated()
    stats = torch.spyre.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.spyre.memory_allocated()
    assert "capacity_bytes" in stats


def test_host_memory_only_for_what_is_allocated():
    # a 1 GiB device tensor must not cost 1 GiB of host RAM until written
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = torch.empty(2**28, device="spyre")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (after - before) * 1024 < 2**28  # KiB on Linux
    del t


def test_oom_on_small_card_is_clear_and_recoverable(spyre_python):
    r = spyre_python(
        """
        import torch, torch_spyre
        keep = torch.ones(1024, 1024, device="spyre")          # 4 MiB
        used = torch.spyre.memory_allocated()
        try:
            torch.empty(64, 1024, 1024, device="spyre")         # 256 MiB
        except torch.OutOfMemoryError as e:
            msg = str(e)
        else:
            raise SystemExit("no OOM")
        assert "spyre:0 is out of device memory" in msg, msg
        assert "256.00 MiB" in msg and "64.00 MiB" in msg and "4.00 MiB are in use" in msg, msg
        assert torch.spyre.memory_allocated() == used
        assert torch.spyre.memory_stats()["num_ooms"] == 1
        assert keep.sum().item() == 1024 * 1024               # other tensors intact
        again = torch.ones(1024, 1024, device="spyre")         # later allocations work
        assert again.cpu().sum() == 1024 * 1024
        print("ok")
        """,
        TORCH_SPYRE_DEVICE_MEMORY="64MiB",
    )
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_torch_accelerator_memory_api(spyre_python):
    """torch.accelerator's memory API reaches the card's allocator (a
    c10::DeviceAllocator) and host allocator, as vLLM's shutdown calls it."""
    r = spyre_python(
        """
        import torch
        assert torch.accelerator.current_accelerator().type == "spyre"
        x = torch.ones(1000, 100).to("spyre")
        torch.accelerator.empty_cache()
        torch.accelerator.empty_host_cache()
        n = torch.spyre.memory_allocated()
        assert n > 0 and torch.accelerator.memory_allocated() == n
        free, total = torch.accelerator.get_memory_info()
        assert total - free == n, (free, total, n)
        st = torch.accelerator.memory_stats()
        assert st["allocated_bytes.all.current"] == n and st["reserved_bytes.all.peak"] >= n
        torch.accelerator.reset_peak_memory_stats()
        del x
        assert torch.accelerator.memory_allocated() == 0
        assert torch.accelerator.max_memory_allocated() == n
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok" in r.stdout
