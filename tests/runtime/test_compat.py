"""IBM's public torch-spyre names over ours (torch_spyre/compat/, docs/compat.md)."""

import warnings

import pytest
import torch

import torch_spyre
from torch_spyre import compat
from torch_spyre.layout import SpyreTensorLayout

F16 = torch.float16


def slot_major(num_slots, num_kv_heads, head_size, dtype=F16):
    """IBM's slot-major KV page layout, as spyre-inference builds it."""
    from torch_spyre._C import SpyreTensorLayout, get_device_dtype, get_elem_in_stick

    eps = get_elem_in_stick(dtype)
    sticks = (head_size + eps - 1) // eps
    return SpyreTensorLayout(
        device_size=[num_slots, num_kv_heads, sticks, eps],
        stride_map=[num_kv_heads * sticks * eps, sticks * eps, eps, 1],
        device_dtype=get_device_dtype(dtype),
    )


def test_one_layout_class_under_ibm_names():
    from torch.spyre import SpyreTensorLayout as from_torch_spyre
    from torch_spyre._C import SpyreTensorLayout as from_c

    assert from_torch_spyre is from_c is SpyreTensorLayout is torch_spyre.SpyreTensorLayout


def test_ibm_constructor_forms_and_repr():
    from torch.spyre import DataFormats, get_device_dtype

    default = SpyreTensorLayout([512, 240], F16)
    assert default == SpyreTensorLayout.default((512, 240), F16)
    assert repr(default) == (
        "SpyreTensorLayout(device_size=[4, 512, 64], stride_map =[64, 240, 1], "
        "device_dtype=DataFormats.SEN169_FP16)"
    )
    assert SpyreTensorLayout([512, 240], [240, 1], F16, [0, 1]) == default
    # dim_order [1, 0]: the stick dim is host dim 0
    t = SpyreTensorLayout([512, 240], [240, 1], F16, [1, 0])
    assert t.device_size == (8, 240, 64) and t.stride_map == (15360, 1, 240)
    from_device = SpyreTensorLayout(
        device_size=[4, 512, 64], stride_map=[64, 240, 1], device_dtype=DataFormats.SEN169_FP16
    )
    assert from_device == default and from_device.host_size == (512, 240)
    assert default.elems_per_stick() == 64 and default.device_dtype is DataFormats.SEN169_FP16
    assert get_device_dtype(torch.int64) is DataFormats.IEEE_INT64  # no downcast here
    assert compat.get_elem_in_stick(torch.int64) == 16


def test_bad_ibm_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="only the last entry may be -1"):
        SpyreTensorLayout([4, 64], [64, 1], F16, [0, -1, -1])
    with pytest.raises(ValueError, match="permutation"):
        SpyreTensorLayout([4, 64], [64, 1], F16, [0, 0])
    with pytest.raises(ValueError, match="one stick of 64"):
        SpyreTensorLayout(device_size=[4, 32], stride_map=[32, 1], device_dtype=F16)
    with pytest.raises(TypeError, match="SpyreTensorLayout\\(size, dtype\\)"):
        SpyreTensorLayout([4, 64])
    with pytest.raises(TypeError, match="float64"):
        compat.get_device_dtype(torch.float64)


def test_slot_major_kv_pages_through_to_and_factories():
    nb, bs, nkvh, hs = 3, 64, 2, 128
    lay = slot_major(nb * bs, nkvh, hs)
    assert lay.host_size == (nb * bs, nkvh, hs) and lay.dim_map == (0, 1, 2, 2)
    host = torch.randn(nb, bs, nkvh, hs, dtype=F16)
    pages = host.to("spyre", device_layout=lay)
    assert pages.shape == host.shape
    assert compat.same_device_layout(pages.device_tensor_layout(), lay)
    assert pages.device_tensor_layout().device_size == (nb * bs, nkvh, 2, 64)
    assert torch.equal(pages.cpu(), host)
    # the KV write and the page read the attention backend does
    slots = torch.tensor([0, 7, 65, 100, 191])
    key = torch.randn(5, nkvh, hs, dtype=F16)
    pages.view(-1, nkvh, hs).index_copy_(0, slots.to("spyre"), key.to("spyre"))
    ref = host.view(-1, nkvh, hs).clone().index_copy_(0, slots, key).view(host.shape)
    assert torch.equal(pages.cpu(), ref)
    page = pages.index_select(0, torch.tensor([2], dtype=torch.int32, device="spyre"))
    assert torch.equal(page.cpu(), ref[2:3])
    # same layout, no copy requested: the tensor itself
    assert pages.to("spyre", device_layout=lay) is pages
    assert pages.to("spyre", device_layout=lay, copy=True) is not pages
    for make in (torch.empty, torch.zeros):
        t = make(nb, bs, nkvh, hs, dtype=F16, device="spyre", device_layout=lay)
        assert t.shape == (nb, bs, nkvh, hs)
        assert compat.same_device_layout(t.device_tensor_layout(), lay)
    assert torch.zeros((nb, bs, nkvh, hs), dtype=F16, device_layout=lay).cpu().abs().sum() == 0
    ones = torch.ones([4, 64], dtype=F16, device_layout=SpyreTensorLayout([4, 64], F16))
    assert ones.device.type == "spyre" and ones.cpu().sum() == 256
    full = torch.full((4, 64), 3.0, dtype=F16, device_layout=SpyreTensorLayout([4, 64], F16))
    assert full.cpu().eq(3).all()


def test_hf_adapters_cache_position_first_layout():
    B, n_kv, L, hd = 2, 3, 128, 64
    eps = SpyreTensorLayout([B, n_kv, L, hd], F16).elems_per_stick()
    lay = SpyreTensorLayout(
        device_size=[L, n_kv, 1, B, eps],
        stride_map=[hd, L * hd, eps, n_kv * L * hd, 1],
        device_dtype=compat.get_device_dtype(F16),
    )
    host = torch.randn(B, n_kv, L, hd, dtype=F16)
    cache = torch.empty(
        (B, n_kv, L, hd), device=torch.device("spyre"), device_layout=lay, dtype=F16
    )
    got = cache.device_tensor_layout()
    assert got.host_size == (B, n_kv, L, hd) and got.dim_map == (2, 1, -1, 0, 3)
    cache.copy_(host.to("spyre"))
    assert torch.equal(cache.cpu(), host)


def test_device_layout_misuse_is_a_clear_error():
    lay = SpyreTensorLayout([4, 64], F16)
    with pytest.raises(ValueError, match="lays out 256 elements"):
        torch.empty(8, 64, dtype=F16, device_layout=lay)  # more elements than it holds
    # (fewer fit: [4, 32] folds into its first two sticks, as IBM's folded layouts)
    assert torch.equal(torch.ones(4, 32, dtype=F16, device_layout=lay).cpu(), torch.ones(4, 32))
    with pytest.raises(ValueError, match="build the layout for torch.float32"):
        torch.randn(4, 64).to("spyre", device_layout=lay)
    # as on IBM's stack, a device layout puts the tensor on spyre, with a warning here
    with pytest.warns(UserWarning, match="not on cpu"):
        assert torch.randn(4, 64, dtype=F16).to("cpu", device_layout=lay).device.type == "spyre"
    with pytest.raises(TypeError, match="SpyreTensorLayout"):
        torch.empty(4, 64, device_layout="rows")


def test_patches_keep_pytorch_behaviour():
    # the factories still honour `with torch.device(...)` (identity-keyed set)
    with torch.device("spyre"):
        assert torch.empty(3).device.type == "spyre"
        assert torch.zeros(2).device.type == "spyre"
        assert torch.ones(2).device.type == "spyre"
    assert torch.full((2,), 7).dtype == torch.int64
    x = torch.ones(4, 64)
    assert x.to(torch.float16).dtype == F16 and x.to("spyre").device.type == "spyre"
    assert torch.Tensor.to.__name__ == "to" and torch.empty.__name__ == "empty"

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        return torch.zeros(t.shape, dtype=t.dtype) + t.to(torch.float32)

    assert torch.equal(f(x), x)


def test_memory_module_and_switches():
    import torch.spyre.memory as memory

    before = memory.memory_allocated()
    t = torch.empty(1000, 1000, device="spyre")
    assert memory.memory_allocated() - before == 32 * 1000 * 32 * 4
    assert memory.max_memory_allocated() >= memory.memory_allocated()
    del t
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == memory.memory_allocated()
    memory.reset_accumulated_memory_stats()
    assert memory.memory_stats()["allocation.all.freed"] == 0
    assert torch.spyre.get_downcast_warning() is True
    torch.spyre.set_downcast_warning(False)
    assert torch.spyre.get_downcast_warning() is False
    torch.spyre.set_downcast_warning(True)


def test_inductor_facades():
    from torch_spyre._inductor import config
    from torch_spyre._inductor.constants import DEVICE_NAME, FP8_E4M3FN_MAX
    from torch_spyre._inductor.decompositions import spyre_decompositions
    from torch_spyre.kernels import options

    assert FP8_E4M3FN_MAX == 448.0 and DEVICE_NAME == "spyre"
    assert spyre_decompositions == {}
    config.hbm_pool_planning = False  # hf-adapters does this: accepted, no effect here
    assert config.hbm_pool_planning is False
    with config.patch({"sencores": 4}):
        assert options.current().cores == 4 and config.sencores == 4
    assert config.sencores == 32 and options.current().cores is None
    with pytest.raises(AttributeError, match="no option 'nonsense'"):
        config.nonsense  # noqa: B018


def test_fallback_warning_is_ours_and_honours_always():
    from torch_spyre.ops.fallbacks import FallbackWarning
    from torch_spyre.runtime.fallback import SpyreFallbackWarning

    assert FallbackWarning is SpyreFallbackWarning
    from torch_spyre.runtime.fallback import fallback_policy

    x = torch.randn(4, 4).to("spyre")
    for flt, expect in ((FallbackWarning, 2), (Warning, 1)):  # IBM's filter; a generic one
        torch_spyre.reset_fallback_counts()
        with warnings.catch_warnings(record=True) as caught, fallback_policy("warn"):
            warnings.simplefilter("always", flt)
            torch.median(x)
            torch.median(x)
        msgs = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        assert len(msgs) == expect and all("median" in m for m in msgs), (flt, msgs)


def test_aiu_world_size_matches_the_cards(spyre_python):
    import os

    assert os.environ["AIU_WORLD_SIZE"] == str(torch.spyre.device_count())
    r = spyre_python(
        "import os, torch; print(torch.spyre.device_count(), os.environ['AIU_WORLD_SIZE'])",
        AIU_WORLD_SIZE="2",
        TORCH_SPYRE_NUM_CARDS="",
    )
    assert r.stdout.split() == ["2", "2"], r.stderr


def test_compiled_kv_write_into_a_device_layout_input():
    """spyre-inference's compiled reshape_and_cache: index_copy_ into slot-major pages
    (a graph input whose storage is not in the default layout)."""

    def write(key, k_slots, slot_mapping):
        k_slots.index_copy_(0, slot_mapping, key)

    compiled = torch.compile(write, dynamic=False)
    nb, bs, nkvh, hs = 4, 64, 2, 128
    host = torch.randn(nb, bs, nkvh, hs, dtype=F16)
    pages = host.to("spyre", device_layout=slot_major(nb * bs, nkvh, hs))
    key = torch.randn(2, nkvh, hs, dtype=F16)
    slots = torch.tensor([5, 200])
    compiled(key.to("spyre"), pages.view(-1, nkvh, hs), slots.to("spyre"))
    ref = host.view(-1, nkvh, hs).clone().index_copy_(0, slots, key)
    assert torch.equal(pages.cpu().view(-1, nkvh, hs), ref)
    assert compat.same_device_layout(pages.device_tensor_layout(), slot_major(nb * bs, nkvh, hs))


def test_eager_kernels_relay_a_device_layout_operand():
    # the whole-operand fast path (C++) must not take a device_layout= storage
    # for a default-layout one
    nb, bs, nkvh, hs = 2, 64, 2, 128
    host = torch.randn(nb * bs, nkvh, hs, dtype=F16)
    pages = host.to("spyre", device_layout=slot_major(nb * bs, nkvh, hs))
    assert pages.device_tensor_layout().host_size == tuple(host.shape)
    torch.testing.assert_close((pages * 2).cpu(), host * 2)
    torch.testing.assert_close(
        pages.sum(-1).cpu().float(), host.float().sum(-1), atol=0.1, rtol=0.01
    )


def test_to_takes_a_dtype_by_name_as_ibms():
    # IBM's model-op YAML records dtypes as strings ("torch.float32")
    assert torch.ones(2).to("torch.float16").dtype == F16
    assert torch.ones(2).to("spyre", "torch.bfloat16").dtype == torch.bfloat16
    assert torch.ones(2).to(dtype="torch.int32").dtype == torch.int32
    with pytest.raises(RuntimeError):
        torch.ones(2).to("torch.nosuchdtype")


@pytest.mark.parametrize("name", ["zeros", "empty", "full", "ones"])
def test_factories_compile_after_dynamos_rules_are_rebuilt(name):
    """``torch.distributed.init_process_group`` (vLLM's engine start) clears
    Dynamo's cached rules, which are then rebuilt from names that now resolve
    to our ``device_layout=`` wrappers.  The original factories must keep
    their in-graph rule: they did not, and every compiled factory call (an
    RNN's initial state) became a graph break for the rest of the process."""
    from torch._dynamo import trace_rules

    trace_rules.clear_lru_cache()  # what init_process_group does
    orig = getattr(torch._C._VariableFunctions, name)
    assert getattr(torch, name) is not orig  # the patched wrapper
    assert trace_rules.lookup(orig).__name__ == "TorchInGraphFunctionVariable"

    args = ((2, 3), 5.0) if name == "full" else (2, 3)

    def f(x):
        return x + getattr(torch, name)(*args, dtype=x.dtype, device=x.device) * 0

    torch._dynamo.reset()
    x = torch.ones(2, 3).to("spyre")
    out = torch.compile(f, backend="eager", fullgraph=True)(x)  # a graph break raises
    torch.testing.assert_close(out.cpu(), torch.ones(2, 3))
