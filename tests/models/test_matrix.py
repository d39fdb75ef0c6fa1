"""Every validated architecture on every path, against the CPU, with no host fallback.

Paths (fp16 on the card, fp32 on the CPU, random weights, seeded):

* **eager**: the stock model ``.to("spyre")`` (no adapter): one forward of a
  12-token prompt, and HF's own ``generate`` (8 greedy tokens, its
  ``isin``-based stopping checks included) for the decoders;
* **generate**: ``models.prepare`` (the adapters found by content) and the
  project's generation loop (static KV / Mamba state cache), 16 greedy
  tokens: identical tokens, the logits of every step compared;
* **compiled** (slow: one compile per model, one layer or one per layer
  kind): ``models.prepare(compile=True)`` through the same loop (a prefill
  and a decode graph), 8 greedy tokens; encoders: one compiled forward (T5:
  its encoder).

Logits (hidden states for encoders) within the fp16 tolerances of
``torch_spyre.testing`` (atol = rtol = 1e-2; the measured differences are in
the table); greedy tokens identical.  Every run is under the fallback policy
``error``.  The rows become the table of docs/models.md (``matrix_table.py``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402
from architectures import DECODERS, ENCODERS, compiled_config  # noqa: E402
from matrix_table import Row, write  # noqa: E402

import torch_spyre  # noqa: E402
import torch_spyre.models as models  # noqa: E402
from torch_spyre import settings  # noqa: E402
from torch_spyre.models.generate import generate  # noqa: E402
from torch_spyre.runtime.fallback import fallback_policy  # noqa: E402
from torch_spyre.testing import tolerances  # noqa: E402

H = torch.float16
TOL = tolerances(H)
ROWS: list[Row] = []


def _ids(n: int = 12, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(cfg, cls=transformers.AutoModelForCausalLM) -> torch.nn.Module:
    torch.manual_seed(0)
    build = getattr(cls, "from_config", None) or cls  # the Auto classes, or the model class
    return build(cfg).eval()


def _out(o) -> torch.Tensor:
    return (o.logits if hasattr(o, "logits") else o.last_hidden_state).float().cpu()


def _record(arch, path, got, want, ms=None, note="") -> None:
    diff = float((got - want).abs().max())
    fb = sum(torch_spyre.fallback_counts().values())
    ROWS.append(Row(arch, path, True, diff, ms, fb, note))


def _tie(cpu_logits: torch.Tensor, cpu_tok: int, dev_tok: int) -> bool:
    """The two tokens' CPU logits are within the fp16 tolerance of each other: at
    the card's precision the greedy choice between them is a tie."""
    a, b = float(cpu_logits[cpu_tok]), float(cpu_logits[dev_tok])
    return abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(a)


def _steps_close(got, want) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``got`` ran with the CPU's tokens fed back (``force_tokens``): its logits
    step by step against the CPU's; its greedy picks equal the CPU's except at
    fp16 ties (counted)."""
    g, w = torch.stack(got.logits), torch.stack(want.logits)
    torch.testing.assert_close(g, w, **TOL)
    ties = 0
    for i, (a, b) in enumerate(zip(want.tokens[0].tolist(), got.tokens[0].tolist())):
        if a != b:
            assert _tie(w[i, 0], a, b), f"step {i}: spyre picked {b}, the CPU {a}"
            ties += 1
    return g, w, ties


def _hf_same(dev_ids: torch.Tensor, ref, ids: torch.Tensor, **kw) -> int:
    """HF generate's tokens on the card equal the CPU's up to the first fp16 tie
    (then the contexts differ); the number of ties (0 or 1)."""
    out = ref.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    cpu, n = out.sequences[0], ids.shape[1]
    dev = dev_ids[0]
    for i in range(n, len(cpu)):
        if dev[i] != cpu[i]:
            assert _tie(out.logits[i - n][0], int(cpu[i]), int(dev[i])), f"HF generate step {i - n}"
            return 1
    assert len(dev) == len(cpu)
    return 0


def _note(ties: int, extra: str = "") -> str:
    parts = [f"{ties} fp16 tie" + ("s" if ties > 1 else "")] if ties else []
    return "; ".join(parts + ([extra] if extra else []))


@pytest.mark.parametrize("arch", list(DECODERS))
def test_decoder_stock_eager(arch: str) -> None:
    ref = _reference(DECODERS[arch]())
    dev = copy.deepcopy(ref).to(H).to("spyre")
    ids = _ids()
    torch_spyre.reset_fallback_counts()
    kw = dict(max_new_tokens=8, do_sample=False)
    with torch.no_grad(), fallback_policy("error"):
        got = _out(dev(ids.to("spyre")))
        hf = dev.generate(
            ids.to("spyre"), attention_mask=torch.ones_like(ids).to("spyre"), **kw
        ).cpu()
    assert torch_spyre.fallback_counts() == {}
    with torch.no_grad():
        want = _out(ref(ids))
        ties = _hf_same(hf, ref, ids, attention_mask=torch.ones_like(ids), **kw)
    torch.testing.assert_close(got, want, **TOL)
    _record(arch, "eager", got, want, note=_note(ties))


@pytest.mark.parametrize("arch", list(DECODERS))
def test_decoder_generate(arch: str) -> None:
    ref = _reference(DECODERS[arch]())
    dev = models.prepare(copy.deepcopy(ref), dtype=H)
    ids = _ids(10, seed=4)
    want = generate(ref, ids, 16, keep_logits=True)
    torch_spyre.reset_fallback_counts()
    with fallback_policy("error"):
        got = generate(dev, ids, 16, keep_logits=True, force_tokens=want.tokens)
    assert torch_spyre.fallback_counts() == {}
    g, w, ties = _steps_close(got, want)
    _record(arch, "generate", g, w, got.decode_ms_per_token[0], _note(ties, _short(dev)))


def _short(model) -> str:
    """The patches the adapter applied (for the table)."""
    return " ".join(p.split(":")[0] for p in model.spyre_patches)


@pytest.mark.slow  # one compile per model (~5-25 s each on 2 cores)
@pytest.mark.parametrize("arch", list(DECODERS))
def test_decoder_compiled(arch: str) -> None:
    ref = _reference(compiled_config(arch))
    dev = models.prepare(copy.deepcopy(ref), dtype=H, compile=True)
    ids = _ids(10, seed=4)
    want = generate(ref, ids, 8, keep_logits=True)
    torch._dynamo.reset()
    torch_spyre.reset_fallback_counts()
    # no host fallback, and no degrade step either: every group plans
    with fallback_policy("error"), settings.override(compile_fallback="error"):
        got = generate(dev, ids, 8, keep_logits=True, force_tokens=want.tokens)
    assert torch_spyre.fallback_counts() == {}
    g, w, ties = _steps_close(got, want)
    _record(arch, "compiled", g, w, got.decode_ms_per_token[0], _note(ties))


def _encoder_inputs(arch: str):
    ids = _ids()
    return (
        {"input_ids": ids} if arch != "t5" else {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    )


@pytest.mark.parametrize("arch", list(ENCODERS))
def test_encoder_stock_eager(arch: str) -> None:
    cls = transformers.T5ForConditionalGeneration if arch == "t5" else transformers.AutoModel
    ref = _reference(ENCODERS[arch](), cls)
    dev = copy.deepcopy(ref).to(H).to("spyre")
    inputs = _encoder_inputs(arch)
    torch_spyre.reset_fallback_counts()
    with torch.no_grad(), fallback_policy("error"):
        got = _out(dev(**{k: v.to("spyre") for k, v in inputs.items()}))
        if arch == "t5":  # encoder-decoder: HF's generate too
            hf = dev.generate(inputs["input_ids"].to("spyre"), max_new_tokens=6).cpu()
            assert torch.equal(hf, ref.generate(inputs["input_ids"], max_new_tokens=6))
    assert torch_spyre.fallback_counts() == {}
    with torch.no_grad():
        want = _out(ref(**inputs))
    torch.testing.assert_close(got, want, **TOL)
    _record(arch, "eager", got, want)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ENCODERS))
def test_encoder_compiled(arch: str) -> None:
    cls = transformers.T5EncoderModel if arch == "t5" else transformers.AutoModel
    ref = _reference(compiled_config(arch), cls)
    dev = models.prepare(copy.deepcopy(ref), dtype=H, compile=True)
    ids = _ids()
    torch._dynamo.reset()
    torch_spyre.reset_fallback_counts()
    with (
        torch.no_grad(),
        fallback_policy("error"),
        settings.override(compile_fallback="error"),
    ):
        got = _out(dev(input_ids=ids.to("spyre")))
    assert torch_spyre.fallback_counts() == {}
    with torch.no_grad():
        want = _out(ref(input_ids=ids))
    torch.testing.assert_close(got, want, **TOL)
    _record(arch, "compiled", got, want, note="encoder" if arch == "t5" else "")


def test_zz_write_the_table(tmp_path_factory) -> None:
    """The rows this run measured, as docs/models.md's table (see matrix_table)."""
    if not ROWS:
        pytest.skip("no architecture ran")
    out = os.environ.get("TORCH_SPYRE_MATRIX_OUT")
    path = Path(out) if out else tmp_path_factory.mktemp("matrix") / "matrix.json"
    write(ROWS, path)
    assert all(r.passed and r.fallbacks == 0 for r in ROWS)
