"""vLLM's forward traced once and saved (``vllm_plugin/compile.py``, "Saved
trace"; ``compiler/precompiled.py``, ``compiler/saved_graph.py``): a later
engine loads the trace with the token count symbolic and compiles each
bucket from the caches, with no Dynamo trace; the answers are the traced
forward's, the weights the module's own at each call."""

from __future__ import annotations

import pytest
import torch

from torch_spyre.compiler import piecewise, regions, saved_graph

D = 64


class Block(torch.nn.Module):
    """A gated MLP whose gate and up halves come from one projection (a
    method call on a traced value: its fake value must be kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(D, 4 * D, bias=False)
        self.out = torch.nn.Linear(2 * D, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).view(h.shape[0], 2, 2 * D).unbind(1)
        return h + self.out(torch.nn.functional.silu(gate) * up)


class Toy(torch.nn.Module):
    """vLLM's forward signature: token ids and positions, one row per token."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.dtype = torch.float32  # as vLLM's modules keep one (precompiled._singletons_saved)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * (1 + positions.float()[:, None] / 64)
        for block in self.blocks:
            h = block(h)
        if DOUBLED:  # global state the trace reads (as the LoRA path's step flag)
            h = h * 2
        return h


DOUBLED = False


LENGTHS = [5, 16, 20]


def _inputs() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return {
        n: (torch.randint(0, 100, (n,), generator=g), torch.randint(0, 64, (n,), generator=g))
        for n in LENGTHS
    }


def _engine(model_cpu: Toy):
    """A fresh process's view: Dynamo's and the pieces' in-memory caches empty."""
    from torch_spyre.vllm_plugin.compile import CompiledForward, register_spyre_attention_ops

    register_spyre_attention_ops()
    torch._dynamo.reset()
    piecewise.clear()
    dev = Toy(len(model_cpu.blocks))
    dev.load_state_dict(model_cpu.state_dict())
    compiled = CompiledForward(dev.to("spyre"), max_tokens=32, config_hash="test")
    with torch.no_grad():
        outs = {n: compiled(ids, pos).cpu() for n, (ids, pos) in _inputs().items()}
    regions.unmark(compiled.model)
    return compiled, outs


@pytest.fixture
def saved(spyre_settings, tmp_path):
    spyre_settings(vllm_regions=True, vllm_piecewise=True, precompile=True,
                   cache_dir=str(tmp_path / "cache"))  # fmt: skip


def test_a_second_engine_loads_the_trace(saved):
    torch.manual_seed(0)
    model = Toy().eval()
    with torch.no_grad():
        ref = {n: model(ids, pos) for n, (ids, pos) in _inputs().items()}
    first, outs1 = _engine(model)
    assert first.summary()["traces"] == 1
    st = first.summary()["saved_trace"]
    assert st["built"] == 1 and st["saved"] == 1
    second, outs2 = _engine(model)
    s = second.summary()
    assert s["traces"] == 0  # no Dynamo trace: the saved one, every bucket
    st = s["saved_trace"]
    assert st["loaded"] == 1 and st["calls"] == len(LENGTHS)
    assert not st["why"], st["why"]
    assert s["graphs"] == 2  # each bucket compiled for its static shapes
    assert not s["aot_cache"].get("bypass"), s  # through AOTAutograd's cache
    for n in LENGTHS:
        torch.testing.assert_close(outs1[n], ref[n])  # fp32 on both: tight
        assert torch.equal(outs2[n], outs1[n])


def test_the_weights_are_the_modules_own(saved):
    torch.manual_seed(0)
    _engine(Toy().eval())
    other = Toy().eval()  # other weights: the same key, the same saved trace
    with torch.no_grad():
        ref = {n: other(ids, pos) for n, (ids, pos) in _inputs().items()}
    compiled, outs = _engine(other)
    assert compiled.summary()["saved_trace"]["loaded"] == 1 and compiled.summary()["traces"] == 0
    for n in LENGTHS:
        torch.testing.assert_close(outs[n], ref[n])


def test_another_config_hash_traces_again(saved):
    from torch_spyre.vllm_plugin.compile import CompiledForward

    torch.manual_seed(0)
    model = Toy().eval()
    _engine(model)
    torch._dynamo.reset()
    dev = Toy().to("spyre")
    compiled = CompiledForward(dev, max_tokens=32, config_hash="another engine config")
    with torch.no_grad():
        compiled(*_inputs()[5])
    assert compiled.summary()["traces"] == 1 and compiled.summary()["saved_trace"]["built"] == 1
    regions.unmark(dev)


def test_a_saved_graph_keeps_the_fake_values_its_pieces_read():
    """Only the inputs, the values that cross a cut and the receivers of
    method calls keep their fake values; the graph loads into a fresh fake
    mode with the token count still a symbol."""
    from torch_spyre.vllm_plugin.compile import _is_attention

    captured = {}

    def backend(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    model = Toy(2)
    ids, pos = _inputs()[5]
    torch._dynamo.maybe_mark_dynamic(ids, 0)
    torch._dynamo.maybe_mark_dynamic(pos, 0)
    torch.compile(model, backend=backend, fullgraph=True)(ids, pos)
    gm = captured["gm"]
    loaded = saved_graph.loads(saved_graph.dumps(gm, _is_attention))
    assert [n.op for n in loaded.graph.nodes] == [n.op for n in gm.graph.nodes]
    kept = [n for n in loaded.graph.nodes if "example_value" in n.meta]
    assert 0 < len(kept) < len(list(loaded.graph.nodes))
    assert all(n.meta for n in loaded.graph.nodes if n.op == "placeholder")
    assert any(piecewise.symbolic(n.meta["example_value"]) for n in kept)
    assert all("example_value" in n.meta for n in gm.graph.nodes if n.op != "output")  # left as is


def test_a_saved_forward_loads_only_for_its_engine():
    from torch_spyre.vllm_plugin.compile import PerBucket

    with pytest.raises(RuntimeError, match="loads only through CompiledForward"):
        PerBucket.deserialize_compile_artifacts(b"")


def test_a_saved_forward_checks_the_global_state_its_trace_read(saved, monkeypatch):
    """Torch cannot save a guard on a global; the entry checks the value
    itself, so a call with the flag changed is refused (torch.compile's own
    path traces it), never run with the traced branch."""
    torch.manual_seed(0)
    model = Toy().eval()
    first, _ = _engine(model)
    monkeypatch.setitem(globals(), "DOUBLED", True)
    with torch.no_grad():
        ref = {n: model(ids, pos) for n, (ids, pos) in _inputs().items()}
    second, outs = _engine(model)
    st = second.summary()["saved_trace"]
    assert st["loaded"] == 1 and st["calls"] == 0
    assert "G['DOUBLED'] is True, the trace read False" in st["why"]["(loaded entry)"]
    for n in LENGTHS:
        torch.testing.assert_close(outs[n], ref[n])
