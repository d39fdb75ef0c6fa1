"""RNN, LSTM and GRU layers and cells as device kernel programs (ops/recurrent.py).

Every case runs on spyre and on the CPU and is compared with
``torch.testing.assert_close``: fp32 at rtol 1e-4 / atol 1e-5 (the programs
accumulate in fp32 like the CPU; a mismatch is a bug), fp16 at atol 2e-3 /
rtol 2e-3: fp16's eps is 2^-10 (9.8e-4), the CPU rounds after each of a
gate's pointwise ops and the card once per program, and the states (|h| < 1
after tanh) are rounded to fp16 at every step, so the two differ by a few
half-ulps at 1.0; the recurrence is contracting (sigmoid gates < 1), so the
difference does not grow with the steps.  Every case runs with no host
fallback.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import torch_spyre
from torch_spyre.profiler import profile
from torch_spyre.runtime import dispatch_stats

FP32 = {"rtol": 1e-4, "atol": 1e-5}
FP16 = {"rtol": 2e-3, "atol": 2e-3}


@pytest.fixture(autouse=True)
def _counts():
    torch_spyre.reset_fallback_counts()
    dispatch_stats.reset()
    yield


def _to(x, dev):
    if isinstance(x, PackedSequence):
        return x.to(dev)
    if isinstance(x, tuple):
        return tuple(_to(t, dev) for t in x)
    return x.to(dev)


def _run(module, x, hx=None, dtype=torch.float32, tol=FP32):
    """Run on the CPU and on spyre, compare every output, no host fallback."""
    module = module.eval().to(dtype)
    x = x.to(dtype) if isinstance(x, torch.Tensor) else x
    hx = (
        None
        if hx is None
        else _to(tuple(h.to(dtype) for h in hx) if isinstance(hx, tuple) else hx.to(dtype), "cpu")
    )
    with torch.no_grad():
        ref = module(x) if hx is None else module(x, hx)
        module.to("spyre")
        out = module(_to(x, "spyre")) if hx is None else module(_to(x, "spyre"), _to(hx, "spyre"))
    module.cpu()
    assert torch_spyre.fallback_counts() == {}
    flat_ref = torch.utils._pytree.tree_flatten(ref)[0]
    flat_out = torch.utils._pytree.tree_flatten(out)[0]
    assert len(flat_ref) == len(flat_out)
    for o, r in zip(flat_out, flat_ref):
        if isinstance(r, torch.Tensor) and r.is_floating_point():
            assert o.device.type == "spyre"
            torch.testing.assert_close(o.cpu(), r, **tol)
        elif isinstance(r, torch.Tensor):  # a PackedSequence's batch sizes / indices
            assert torch.equal(o.cpu(), r)
    return out


T, B, IN, H = 5, 3, 6, 8


@pytest.mark.parametrize("cls", ["LSTM", "GRU", "RNN_TANH", "RNN_RELU"])
@pytest.mark.parametrize(
    "layers,bidirectional,batch_first,with_h0",
    [
        (1, False, False, False),
        (2, True, False, True),
        (2, False, True, True),
        (1, True, True, False),
    ],
)
def test_layers_match_the_cpu(cls, layers, bidirectional, batch_first, with_h0):
    torch.manual_seed(0)
    kw = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    if cls == "LSTM":
        m = torch.nn.LSTM(IN, H, **kw)
    elif cls == "GRU":
        m = torch.nn.GRU(IN, H, **kw)
    else:
        m = torch.nn.RNN(IN, H, nonlinearity=cls[4:].lower(), **kw)
    x = torch.randn(B, T, IN) if batch_first else torch.randn(T, B, IN)
    d = 2 if bidirectional else 1
    hx = None
    if with_h0:
        hx = torch.randn(layers * d, B, H)
        if cls == "LSTM":
            hx = (hx, torch.randn(layers * d, B, H))
    _run(m, x, hx)
    kernels = dispatch_stats.counts("kernel")
    # the recurrence as programs: one input projection per layer and direction,
    # one fused program per timestep
    assert kernels["rnn_input_projection"] == layers * d
    step = {"LSTM": "lstm", "GRU": "gru"}.get(cls, cls.lower())
    assert kernels[f"{step}_step"] == layers * d * T


def test_odd_sizes_and_projection():
    torch.manual_seed(1)
    m = torch.nn.LSTM(33, 40, num_layers=2, bidirectional=True, proj_size=17)
    hx = (torch.randn(4, 5, 17), torch.randn(4, 5, 40))
    _run(m, torch.randn(7, 5, 33), hx)


def test_larger_layers_use_several_cores():
    torch.manual_seed(2)
    _run(torch.nn.LSTM(128, 256, num_layers=2), torch.randn(12, 16, 128))
    _run(torch.nn.LSTM(128, 256, proj_size=64, batch_first=True), torch.randn(16, 12, 128))
    _run(torch.nn.GRU(128, 256, bias=False), torch.randn(12, 16, 128))


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequences(cls, enforce_sorted):
    torch.manual_seed(3)
    lengths = torch.tensor([5, 3, 2, 5]) if not enforce_sorted else torch.tensor([5, 5, 3, 2])
    x = torch.randn(5, 4, IN)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
    kw = {"proj_size": 3} if cls is torch.nn.LSTM else {}
    m = cls(IN, H, num_layers=2, bidirectional=True, **kw)
    out = _run(m, packed)
    padded, lens = pad_packed_sequence(out[0])
    assert lens.tolist() == lengths.tolist()
    assert {"lstm.data", "gru.data", "rnn_tanh.data"} & set(dispatch_stats.counts("kernel"))


@pytest.mark.parametrize(
    "cell", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell, "relu"], ids=str
)
def test_cells(cell):
    torch.manual_seed(4)
    m = torch.nn.RNNCell(IN, H, nonlinearity="relu") if cell == "relu" else cell(IN, H)
    _run(m, torch.randn(B, IN))
    hx = torch.randn(B, H)
    _run(m, torch.randn(B, IN), (hx, torch.randn(B, H)) if cell is torch.nn.LSTMCell else hx)
    _run(cell(IN, H, bias=False) if cell != "relu" else m, torch.randn(B, IN))


def test_fp16():
    torch.manual_seed(5)
    _run(torch.nn.LSTM(IN, H, num_layers=2, bidirectional=True), torch.randn(T, B, IN),
         dtype=torch.float16, tol=FP16)  # fmt: skip
    _run(torch.nn.GRU(64, 128), torch.randn(T, 8, 64), dtype=torch.float16, tol=FP16)


def test_the_timesteps_are_modelled_one_after_another():
    torch.manual_seed(6)
    m = torch.nn.LSTM(32, 64).to("spyre")
    x = torch.randn(9, 4, 32).to("spyre")
    with torch.no_grad(), profile() as prof:
        m(x)
    names = [k.name for k in prof.kernels]
    proj = [n for n in names if n.startswith("rnn_input_proj")]
    steps = [n for n in names if n.startswith("lstm_step")]
    assert len(proj) == 1 and len(steps) == 9
    assert names.index(proj[0]) < names.index(steps[0])  # the projection comes first
    times = [k.time_s for k in prof.kernels if k.name.startswith("lstm_step")]
    assert all(t > 0 for t in times) and max(times) == pytest.approx(min(times), rel=1e-6)
    assert prof.fallbacks == {}


def test_training_dropout_between_layers_takes_the_counted_fallback():
    m = torch.nn.LSTM(IN, H, num_layers=2, dropout=0.5).train().to("spyre")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        m(torch.randn(T, B, IN).to("spyre"))
    assert sum(n for k, n in torch_spyre.fallback_counts().items() if k.startswith("lstm")) == 1


class _Classifier(torch.nn.Module):
    def __init__(self, rnn: type[torch.nn.Module]) -> None:
        super().__init__()
        self.rnn = rnn(12, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).softmax(-1)


@pytest.mark.parametrize("allow_rnn", [False, True])
@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU])
def test_two_layer_classifier_compiled(rnn, allow_rnn):
    """Dynamo leaves RNN modules out of its graphs by default (they run as the
    eager programs above, between compiled graphs); with ``allow_rnn`` it traces
    them and the compiler gets the decomposed recurrence.  Both: no host."""
    torch.manual_seed(7)
    model = _Classifier(rnn).eval()
    x = torch.randn(4, 10, 12)
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=allow_rnn):
        ref = model(x)
        model.to("spyre")
        torch._dynamo.reset()
        out = torch.compile(model)(x.to("spyre"))
    torch.testing.assert_close(out.cpu(), ref, **FP32)
    assert torch_spyre.fallback_counts() == {}
    kernels = dispatch_stats.counts("kernel")
    assert any(k.startswith("compiled.") for k in kernels)
    step = "lstm_step" if rnn is torch.nn.LSTM else "gru_step"
    assert kernels.get(step, 0) == (0 if allow_rnn else 2 * 10)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.LSTM(IN, H, num_layers=2, bidirectional=True, proj_size=3),
        lambda: torch.nn.GRU(IN, H, batch_first=True),
        lambda: torch.nn.RNN(IN, H),
        lambda: torch.nn.LSTMCell(IN, H),
        lambda: torch.nn.GRUCell(IN, H),
    ],
    ids=["lstm", "gru", "rnn", "lstm_cell", "gru_cell"],
)
def test_gradients_match_the_cpu(make):
    """With gradients wanted the composite forms run (the kernels above have no
    backward): the gradients are PyTorch's, never silently missing."""
    torch.manual_seed(8)
    m = make()
    cell = isinstance(m, torch.nn.RNNCellBase)
    x = torch.randn(B, IN) if cell else torch.randn(T, B, IN)

    def loss(mod, inp):
        out = mod(inp)
        return (out[0] if isinstance(out, tuple) else out).pow(2).sum()

    loss(m, x).backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.to("spyre")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss(m, x.to("spyre")).backward()
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad.cpu(), r, **FP32)
