"""compile_piecewise takes each piece's inputs from the values Dynamo recorded
on the graph (no second run of the split graph on fake tensors): the same
shapes, strides and dtypes as that run gives, and the same results."""

from __future__ import annotations

import torch

from torch_spyre.compiler import piecewise


def _layers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):  # three identical "layers", each cut at a sort (the opaque op)
        h = (x @ w).transpose(0, 1).contiguous().transpose(0, 1)
        x = torch.sort(h, dim=-1).values + x
    return x.sum(-1)


def _describe(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, tuple):  # a structured result (torch.return_types.sort)
        return (type(a).__name__, tuple(_describe(v) for v in a))
    return repr(a)


def _is_cut(n: torch.fx.Node) -> bool:
    return n.target is torch.sort


def _compiled(rerun: bool, seen: list):
    def compile_piece(sub: torch.fx.GraphModule, args: list):
        seen.append([_describe(a) for a in args])
        return sub

    def backend(gm: torch.fx.GraphModule, example_inputs):
        piecewise.clear()
        return piecewise.compile_piecewise(
            gm, example_inputs, _is_cut, compile_piece, salt=f"test{rerun}", rerun=rerun
        )

    torch._dynamo.reset()
    return torch.compile(_layers, backend=backend, fullgraph=True, dynamic=False)


def test_pieces_take_the_inputs_dynamo_recorded(monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    ran: list = []
    run = piecewise.torch.fx.Interpreter.run

    def counted(self, *args, **kwargs):
        ran.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(piecewise.torch.fx.Interpreter, "run", counted)
    by_run: list = []
    out_run = _compiled(True, by_run)(x, w)
    assert ran  # the fake-tensor run of the split graph
    ran.clear()
    by_meta: list = []
    out_meta = _compiled(False, by_meta)(x, w)
    assert by_meta == by_run and len(by_meta) >= 2
    # a transposed (non-contiguous) value crosses a cut: strides are recorded too
    assert any(d[1] == (1, 8) for piece in by_meta for d in piece if len(d) == 3)
    assert not ran  # no second run: the recorded values served
    torch.testing.assert_close(out_meta, out_run)
    torch.testing.assert_close(out_meta, _layers(x, w))
