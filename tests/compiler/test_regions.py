"""Repeated layers traced once (``compiler/regions.py``): a stack of identical
layers marked as one nested compile region is traced by Dynamo once and
stamped out per layer; flattened, the graph computes what the model does."""

from __future__ import annotations

import torch

from torch_spyre.compiler import regions


class Layer(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        residual = x + residual
        h = self.down(torch.nn.functional.silu(self.up(residual))) * self.scale
        return h, residual


class Stack(torch.nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(d) for _ in range(n))
        self.head = torch.nn.ModuleList([torch.nn.Linear(d, d)])  # one member: not marked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.head[0](x + residual)


def _compile(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``model(x)`` through torch.compile with a backend that flattens the
    regions and runs the flat graph; what the backend saw."""
    seen: dict = {}

    def backend(gm, example_inputs):
        calls = _invokes(gm)
        seen["calls"] = len(calls)
        # each call takes its own layer's weights (a region bound per instance
        # was stamped out with the first layer's: regions._region_class)
        seen["weights"] = [
            next(str(a) for a in n.args[2:] if "up_parameters_weight" in str(a)) for n in calls
        ]
        seen["subgraphs"] = len({n.args[0].target for n in calls})
        seen["nodes"] = sum(1 for _ in gm.graph.nodes)
        seen["inlined"] = regions.inline_subgraphs(gm)
        seen["left"] = len(_invokes(gm)) + sum(n.op == "get_attr" for n in gm.graph.nodes)
        seen["flat_nodes"] = sum(1 for _ in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return out, seen


def _invokes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]


def test_identical_layers_are_traced_once_and_flatten_to_the_same_function():
    torch.manual_seed(0)
    model = Stack(6, 32).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
        assert regions.mark_repeated(model) == ["layers"]
        assert torch.equal(model(x), want)  # eager: the marking changes nothing
        got, seen = _compile(model, x)
    # one call per layer, all of one traced subgraph; flattened, no call and
    # no subgraph is left, and the flat graph computes the model (fp32: exact
    # up to the order Inductor-free FX runs the same ops in)
    assert seen["calls"] == 6 and seen["subgraphs"] == 1
    assert len(set(seen["weights"])) == 6, seen["weights"]
    assert seen["inlined"] == 6 and seen["left"] == 0
    assert seen["flat_nodes"] > seen["nodes"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    regions.unmark(model)
    with torch.no_grad():
        got, seen = _compile(model, x)
    assert seen["calls"] == 0 and seen["inlined"] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layers_of_other_classes_are_marked_apart_and_a_nested_list_with_its_layer():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for m in self.inner:
                x = m(x)
            return x

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(Block() for _ in range(3))
    model.mixed = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.ReLU()])
    assert regions.mark_repeated(model) == ["blocks"]  # not blocks.N.inner, not mixed
    marked = [m for m in model.modules() if type(m) is not Block and isinstance(m, Block)]
    assert marked == list(model.blocks)
    region = type(model.blocks[0])
    assert region.__name__.startswith("Block_region_") and region._spyre_region_of is Block
    # found by pickle under its name, as a saved trace of the model needs
    assert (
        getattr(regions, region.__qualname__) is region and region.__qualname__ == region.__name__
    )
    regions.unmark(model)
    assert all(type(m) is Block for m in model.blocks)


class Scaled(Layer):
    """A layer whose trace depends on its index (a Python int it multiplies
    by): every layer of a stack of these is a distinct traced body."""

    def __init__(self, d: int, i: int) -> None:
        super().__init__(d)
        self.i = i

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        h, residual = super().forward(x, residual)
        return h * (self.i + 1), residual


def test_more_distinct_layers_than_dynamos_default_reuse_cap_still_compile_as_regions():
    """A model whose 20 marked layers trace to 20 bodies (per-layer constants,
    as a sliding/global mix does) still compiles and answers as eager: the
    reuse cap is regions.MAX_BODIES, above any model's depth (Dynamo refused
    the whole trace past the former 16: "exceeded maximum reuse entries").
    Bodies used once each are inlined by Dynamo itself: the graph is flat."""
    torch.manual_seed(0)
    model = Stack(1, 16).eval()
    model.layers = torch.nn.ModuleList(Scaled(16, i) for i in range(20))
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)
        assert regions.mark_repeated(model) == ["layers"]
        got, seen = _compile(model, x)
    regions.unmark(model)
    assert seen["left"] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
