"""The torch.spyre module and PyTorch's view of the device."""

import pytest
import torch


def test_device_module_basics():
    assert torch.spyre.is_available()
    assert torch.spyre.device_count() == 1
    assert torch.spyre.current_device() == 0
    torch.spyre.set_device(0)
    with torch.spyre.device(0):
        assert torch.spyre.current_device() == 0
    torch.spyre.synchronize()


def test_accelerator_is_spyre():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "spyre"
    assert torch.accelerator.device_count() == 1


def test_device_properties_come_from_hardware_config():
    p = torch.spyre.get_device_properties(0)
    assert p.cores == 32
    assert p.lx_bytes == 2 * 1024 * 1024
    assert p.memory_bandwidth_Bps == pytest.approx(204.8e9)
    assert p.peak_fp16_flops == pytest.approx(98.304e12)
    assert p.total_memory > 100 * 2**30


def test_tensor_and_module_helpers():
    x = torch.ones(2)
    assert x.spyre().is_spyre
    m = torch.nn.Linear(3, 2).spyre()
    assert m.weight.device.type == "spyre"
    s = torch.UntypedStorage(100, device="spyre")
    assert s.device.type == "spyre" and s.nbytes() == 100


def test_bad_device_index_is_an_error():
    with pytest.raises(RuntimeError, match="spyre:3 does not exist"):
        torch.spyre.set_device(3)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.empty(2, device="spyre:5")
    assert torch.spyre.current_device() == 0


def test_generators_follow_seeds():
    g = torch.Generator(device="spyre")
    g.manual_seed(0)
    a = torch.rand(5, device="spyre", generator=g)
    g.manual_seed(0)
    b = torch.rand(5, device="spyre", generator=g)
    assert torch.equal(a.cpu(), b.cpu())
    torch.manual_seed(1)
    c = torch.randn(3, device="spyre")
    torch.manual_seed(1)
    d = torch.randn(3, device="spyre")
    assert torch.equal(c.cpu(), d.cpu())
    torch.spyre.manual_seed(2)
    state = torch.spyre.get_rng_state()
    e = torch.rand(4, device="spyre")
    torch.spyre.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="spyre").cpu(), e.cpu())


def test_device_rng_does_not_disturb_cpu_rng():
    torch.manual_seed(3)
    ref = torch.rand(3)
    torch.manual_seed(3)
    torch.rand(100, device="spyre")
    assert torch.equal(torch.rand(3), ref)


def test_streams_and_events():
    s = torch.spyre.Stream()
    assert s.device.type == "spyre"
    default = torch.spyre.current_stream()
    with torch.spyre.stream(s):
        assert torch.spyre.current_stream() == s
    assert torch.spyre.current_stream() == default
    s.synchronize()
    assert s.query()
    start = torch.spyre.Event(enable_timing=True)
    end = torch.spyre.Event(enable_timing=True)
    start.record()
    torch.randn(256, 256).to("spyre").cpu()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 0  # modelled PCIe time of the two copies


def test_stream_on_an_indexless_device_is_on_the_current_card():
    s = torch.Stream(torch.device("spyre"))
    assert s.device_index == torch.spyre.current_device()
    with s:  # used to raise "spyre:-1 does not exist"
        assert torch.accelerator.current_stream() == s
    assert torch.accelerator.current_stream() != s
    with torch.spyre.Stream(torch.device("spyre")) as t:
        assert torch.spyre.current_stream() == t


def test_current_and_default_stream_are_spyre_streams():
    for s in (torch.spyre.current_stream(), torch.spyre.default_stream()):
        assert type(s) is torch.spyre.Stream
        assert s == torch.accelerator.current_stream()
    n = torch.spyre.Stream()
    with torch.spyre.stream(n):
        assert type(torch.spyre.current_stream()) is torch.spyre.Stream
        assert torch.spyre.current_stream() == n


def test_autoload_through_torch_backends_entry_point(spyre_python):
    r = spyre_python(
        "import torch; x = torch.ones(3, device='spyre'); print(x.device, torch.spyre.device_count())"
    )
    assert r.returncode == 0, r.stderr
    assert "spyre:0 1" in r.stdout


def test_several_cards_and_copies_between_them(spyre_python):
    r = spyre_python(
        """
        import torch, torch_spyre
        assert torch.spyre.device_count() == 3
        x = torch.randn(5, 70)
        a = x.to("spyre:0"); b = a.to("spyre:2"); c = b.to("spyre:1")
        assert (a.device.index, b.device.index, c.device.index) == (0, 2, 1)
        assert torch.equal(c.cpu(), x)
        with torch.spyre.device(2):
            t = torch.empty(10, device="spyre")
            assert t.device.index == 2 and torch.spyre.current_device() == 2
        assert torch.spyre.memory_allocated(2) > 0
        assert torch.spyre.current_device() == 0
        print("ok")
        """,
        TORCH_SPYRE_NUM_CARDS="3",
    )
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_bad_card_count_is_a_clear_error(spyre_python):
    r = spyre_python(
        "import torch_spyre", TORCH_SPYRE_NUM_CARDS="9", TORCH_DEVICE_BACKEND_AUTOLOAD="0"
    )
    assert r.returncode != 0
    assert "TORCH_SPYRE_NUM_CARDS must be 1..8" in r.stderr


def test_autocast_runs_matmuls_in_fp16():
    m = torch.nn.Linear(8, 8).to("spyre")
    x = torch.randn(2, 8).to("spyre")
    with torch.autocast("spyre", dtype=torch.float16):
        y = m(x)
        s = y.float().sum()
    assert y.dtype == torch.float16 and y.device.type == "spyre"
    assert s.dtype == torch.float32
    ref = m.cpu()(x.cpu())
    torch.testing.assert_close(y.cpu().float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.float16 in torch.spyre.get_amp_supported_dtype()
