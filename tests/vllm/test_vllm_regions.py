"""vLLM's forward traced once (``vllm_plugin/compile.py``, "Traced once";
``compiler/regions.py``): the repeated layers as one nested compile region,
the token count dynamic, each bucket compiled for its static shapes; and the
degrade path when a model's layers cannot be traced as a region."""

from __future__ import annotations

import torch

from torch_spyre.compiler import regions

D = 64


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, 2 * D, bias=False)
        self.down = torch.nn.Linear(2 * D, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.silu(self.up(h)))


class Toy(torch.nn.Module):
    """vLLM's forward signature: token ids and positions, one row per token."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, D)
        self.pos = torch.nn.Embedding(64, D)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return h


def _run_buckets(model_cpu: Toy, lengths: list[int]):
    from torch_spyre.vllm_plugin.compile import CompiledForward, register_spyre_attention_ops

    register_spyre_attention_ops()  # vLLM's attention ops: where a forward is cut
    ref = {n: None for n in lengths}
    g = torch.Generator().manual_seed(1)
    inputs = {
        n: (torch.randint(0, 100, (n,), generator=g), torch.randint(0, 64, (n,), generator=g))
        for n in lengths
    }
    with torch.no_grad():
        for n, (ids, pos) in inputs.items():
            ref[n] = model_cpu(ids, pos)
        dev = Toy(len(model_cpu.layers))
        dev.load_state_dict(model_cpu.state_dict())
        dev = dev.to("spyre")
        torch._dynamo.reset()
        compiled = CompiledForward(dev, max_tokens=32)
        outs = {n: compiled(ids, pos).cpu() for n, (ids, pos) in inputs.items()}
    return compiled, ref, outs


def test_the_forward_is_traced_once_for_every_bucket_with_its_layers_as_one_region(
    spyre_settings, caplog
):
    spyre_settings(vllm_regions=True, vllm_piecewise=True)
    torch.manual_seed(0)
    model = Toy(4).eval()
    with caplog.at_level("WARNING", logger="torch_spyre.compiler"):
        compiled, ref, outs = _run_buckets(model, [5, 16, 20, 3])
    # every size reached Inductor static: none specialised from a symbol
    assert "specialising dynamic size" not in caplog.text
    s = compiled.summary()
    assert s["buckets"] == [16, 32]
    assert s["regions"] == ["layers"] and s["traces"] == 1
    assert s["graphs"] == 2  # one compile per bucket, each for its static shapes
    # compiled at run time, each through AOTAutograd's cache (a warm start loads it)
    assert not s["aot_cache"].get("bypass") and sum(s["aot_cache"].values()) == 2
    for n, out in outs.items():
        torch.testing.assert_close(out, ref[n])  # fp32 on both: tight
    regions.unmark(compiled.model)


def test_layers_that_cannot_be_a_region_are_traced_flat_with_a_warning(
    spyre_settings, caplog, monkeypatch
):
    def untraceable(cls: type) -> type:
        """A region Dynamo cannot capture whole (a graph break inside it:
        ``print``), its layers' own forward unchanged."""

        def forward(self, *args):
            print("inside a region")
            return cls.forward(self, *args)

        marked = torch.compiler.nested_compile_region(forward)
        return type(cls.__name__, (cls,), {"forward": marked, "_spyre_region_of": cls})

    from torch_spyre.vllm_plugin import compile as vllm_compile

    monkeypatch.setattr(regions, "_region_class", untraceable)
    spyre_settings(vllm_regions=True, vllm_piecewise=True)
    torch.manual_seed(0)
    model = Toy(3).eval()
    # vLLM's "vllm" logger does not propagate to the root, where caplog listens
    monkeypatch.setattr(
        vllm_compile.logger, "handlers", [*vllm_compile.logger.handlers, caplog.handler]
    )
    with caplog.at_level("WARNING", logger=vllm_compile.logger.name):
        compiled, ref, outs = _run_buckets(model, [5, 20])
    s = compiled.summary()
    # the region failed to trace; the forward was traced again as before
    # this existed: every layer, every bucket; the answers the same
    assert s["regions"] == [] and not compiled.regions
    assert s["graphs"] == 2
    assert any("TORCH_SPYRE_VLLM_REGIONS=0" in r.getMessage() for r in caplog.records)
    assert all(type(m) is Layer for m in compiled.model.layers)  # unmarked
    for n, out in outs.items():
        torch.testing.assert_close(out, ref[n])
