"""The card's DL16 format (torch_spyre.dl16) and the DL16 mode of device memory."""

from __future__ import annotations

import json
import struct

import torch

from torch_spyre import dl16


def _encode_ref(f: float) -> int:
    """IBM's NNP1 conversion (onnx-mlir DLF16Conversion.hpp), one value at a time."""
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    e = ((b >> 23) & 0xFF) - 127 + 31
    frac = (b & 0x7FFFFF) + (1 << 13)
    if frac > 0x7FFFFF:
        frac, e = 0, e + 1
    u = ((b >> 31) & 1) << 15
    nmax = ((63 + 127 - 31) << 23) | (510 << 14) | ((1 << 13) - 1)
    if e >= 0:
        u |= (e << 9) | (frac >> 14) if (b & 0x7FFFFFFF) <= nmax else 0x7FFF
    return u


def test_encode_matches_ibms_conversion():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-12, 12, 20000)
    special = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        8.57e9,
        8.6e9,
        2.0**-31,
        2.0**-32,
        float("inf"),
        float("nan"),
    ]
    x = torch.cat([x, torch.tensor(special)])
    want = torch.tensor([_encode_ref(v) for v in x.tolist()], dtype=torch.int32).to(torch.int16)
    assert torch.equal(dl16.encode(x), want)


def _decode_ref(u: int) -> float:
    """The value of DL16 bits ``u`` (0..65535), from the format's definition."""
    sign = -1.0 if u >> 15 else 1.0
    mag = u & 0x7FFF
    if mag == 0x7FFF:
        return float("nan")
    if mag == 0:
        return sign * 0.0
    return sign * 2.0 ** ((mag >> 9) - 31) * (1 + (mag & 0x1FF) / 512)


def test_decode_is_exact_and_round_trips():
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    vals = dl16.decode(bits)
    want = torch.tensor([_decode_ref(u) for u in range(65536)], dtype=torch.float64)
    assert torch.equal(vals.double().nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(vals.view(torch.int32) < 0, bits < 0)  # signs, of zeros too
    finite = ~vals.isnan()
    assert int((~finite).sum()) == 2  # NINF, per sign
    assert torch.equal(dl16.encode(vals[finite]), bits[finite])
    assert float(vals[finite].max()) == dl16.MAX
    # 9 fraction bits: 1 + 2^-9 is the next value after 1; ties round away from zero
    assert dl16.round_trip(torch.tensor([1 + 2**-10, 1 + 2**-11])).tolist() == [1 + 2**-9, 1.0]


CODE = r"""
import json, torch, torch_spyre
from torch_spyre import dl16
x = torch.tensor([[1.0, 1000.0, 3000.0, 0.1, -2.5, 60000.0]], dtype=torch.float16)
d = x.to("spyre")
back = d.cpu()
# an unpromoted RMSNorm (IBM's): x*x of activations in the thousands
var = d.pow(2).mean(-1, keepdim=True)
y = (d * torch.rsqrt(var + 1e-5)).cpu()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
compiled = torch.compile(lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))(d).cpu()
print(json.dumps({
    "back": back.float().tolist(), "want_back": dl16.round_trip(x).half().float().tolist(),
    "eager_err": float((y.float() - ref).abs().max() / ref.abs().max()),
    "compiled_err": float((compiled.float() - ref).abs().max() / ref.abs().max()),
    "fp16_overflows": bool(torch.isinf(x * x).any()),
}))
"""


def test_dl16_device_memory_holds_the_cards_range(spyre_python):
    proc = spyre_python(CODE, TORCH_SPYRE_FP16_FORMAT="dl16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # a copy to the card rounds to DL16's 9 fraction bits (60000 -> 60032)
    assert r["back"] == r["want_back"] and r["back"][0][5] == 60032.0
    # x*x overflows IEEE fp16 but not DL16: the norm comes out right
    assert r["fp16_overflows"]
    assert r["eager_err"] < 4e-3 and r["compiled_err"] < 4e-3, r


def test_ieee_is_the_default_and_bit_exact():
    from torch_spyre import layout

    assert layout.FP16_FORMAT == "ieee"
    x = torch.randn(300).half()
    assert torch.equal(x.to("spyre").cpu(), x)
