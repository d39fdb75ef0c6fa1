"""``spyre estimate --spec``: the verification step planned (k + 1 query
positions per request, the LM head on every row), the expected tokens per
step from the acceptance rate, and drafting's cost (n-gram: none on the card;
a draft model: its own planned steps)."""

from __future__ import annotations

import json

import pytest

from torch_spyre import cli
from torch_spyre.models import estimate as E
from torch_spyre.models import parallel
from torch_spyre.models import spec_estimate as S

CONFIG = {
    "model_type": "qwen3", "vocab_size": 384, "hidden_size": 256, "intermediate_size": 640,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
PROMPT, NEW, K = 32, 16, 3


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(CONFIG))
    return str(p)


@pytest.fixture(scope="module")
def target(config_path) -> E.Estimate:
    cfg = parallel.load_config(config_path)
    return E.estimate(config_path, prompt=PROMPT, new_tokens=NEW, config=cfg, spec_tokens=K)


def test_expected_tokens_per_step():
    assert S.expected_tokens(3, 0.0) == 1.0
    assert S.expected_tokens(3, 1.0) == 4.0
    assert S.expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert S.SpecOptions.parse("ngram, 3, 0.7") == S.SpecOptions("ngram", 3, 0.7)
    for bad, what in [
        ("ngram,3", "METHOD,k,acceptance"),
        ("eagle,3,0.5", "one of ngram, draft_model"),
        ("ngram,0,0.5", "1..16"),
        ("ngram,3,1.5", "probability"),
        ("ngram,x,0.5", "integer"),
    ]:
        with pytest.raises(ValueError, match=what):
            S.SpecOptions.parse(bad)


def test_verification_step_is_planned_over_k_plus_one_positions(target):
    assert target.spec_tokens == K and [p.name for p in target.verify] == [
        p.name for p in target.decode
    ]
    head = lambda parts: next(p for p in parts if p.name.startswith("final norm"))  # noqa: E731
    layer = lambda parts: next(p for p in parts if p.name.startswith("decoder"))  # noqa: E731
    # the LM head runs on the k + 1 rows of the request: k + 1 times the FLOP
    flops = lambda part: sum(k.flops for k in part.plans)  # noqa: E731
    assert flops(head(target.verify)) == pytest.approx((K + 1) * flops(head(target.decode)))
    assert flops(layer(target.verify)) > flops(layer(target.decode))
    assert target.verify_s > 0 and target.to_json()["verify_s"] == target.verify_s
    plan = S.plan(target, S.SpecOptions("ngram", K, 0.6))
    assert plan.draft_s == 0.0 and plan.step_s == target.verify_s
    assert plan.tokens_per_s_per_request == pytest.approx(S.expected_tokens(K, 0.6) / plan.step_s)
    assert plan.speedup == pytest.approx(plan.tokens_per_s_per_request * target.decode_s)
    assert "tokens per step" in plan.format()


def test_draft_model_costs_its_own_planned_steps(config_path, target):
    cfg = parallel.load_config(config_path)
    common = dict(prompt=PROMPT, new_tokens=NEW, spec_tokens=K)
    draft, label = S.draft_estimate("layers=1", config_path, cfg, common)
    assert label.endswith("first 1 of 2 layers") and draft.layers == {"full_attention": 1}
    plan = S.plan(target, S.SpecOptions("draft_model", K, 0.8), draft, label)
    assert plan.draft_s == pytest.approx(draft.verify_s + (K - 1) * draft.decode_s)
    assert plan.draft_weights_bytes == draft.weights_bytes < target.weights_bytes
    with pytest.raises(ValueError, match="--draft"):
        S.plan(target, S.SpecOptions("draft_model", K, 0.8))
    with pytest.raises(ValueError, match="layers=N: N in 1..1"):
        S.draft_estimate("layers=2", config_path, cfg, common)


def test_spec_cli(config_path, tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["estimate", config_path, "--prompt", str(PROMPT), "--new-tokens", str(NEW)]
    assert cli.main([*argv, "--spec", "ngram,3,0.7", "--json", str(out)]) == 0
    assert "speculation (ngram, k=3, acceptance 0.70" in capsys.readouterr().out
    sp = json.loads(out.read_text())["speculation"]
    assert sp["tokens_per_step"] == pytest.approx(S.expected_tokens(3, 0.7))
    with pytest.raises(SystemExit, match="--draft"):
        cli.main([*argv, "--draft", "layers=1"])
    with pytest.raises(SystemExit, match="--draft"):
        cli.main([*argv, "--spec", "draft_model,3,0.7"])


def test_serve_plan_with_speculation(config_path, target):
    """--serve --spec: vLLM's scheduler schedules each decoding request's k
    drafts; accepted drafts are tokens gained, so a high acceptance finishes
    the same requests in fewer steps with a lower TPOT."""
    from torch_spyre.models import serve_plan

    cfg = parallel.load_config(config_path)
    many = E.estimate(
        config_path, prompt=PROMPT, new_tokens=NEW, config=cfg, batch=4, spec_tokens=K
    )
    kw = dict(rate=50.0, input_len=PROMPT, output_len=NEW, requests=20)
    plain = serve_plan.plan(target, many, cfg, **kw)
    spec = serve_plan.plan(target, many, cfg, speculation=S.SpecOptions("ngram", K, 0.9), **kw)
    assert spec.step_model.decode_1_s == target.verify_s
    assert spec.steps < 0.6 * plain.steps
    assert spec.pct(spec.tpot_s, 50) < plain.pct(plain.tpot_s, 50)
    assert len(spec.tpot_s) == len(plain.tpot_s) == 20


def test_lora_programs_in_the_decode_step(config_path, target):
    """--lora N,rank: the decode step is each layer compiled with the op
    spyre::punica_sgmv after every projection (one grouped program each over
    the step's tokens, N adapters resident), as a served step with adapter
    tokens runs; the LoRA cost is that step less the step without adapters,
    which includes the fusions the op splits."""
    from torch_spyre.models import lora_estimate as L

    assert L.LoraOptions.parse("4, 16") == L.LoraOptions(4, 16)
    with pytest.raises(ValueError, match="N,rank"):
        L.LoraOptions.parse("4")
    cfg = parallel.load_config(config_path)
    opts = L.LoraOptions(4, 16)
    est = E.estimate(config_path, prompt=PROMPT, new_tokens=NEW, config=cfg, batch=4, lora=opts)
    plain = E.estimate(config_path, prompt=PROMPT, new_tokens=NEW, config=cfg, batch=4)
    (layer,) = [p for p in est.decode if p.name.startswith("decoder layer")]
    (base,) = [p for p in plain.decode if p.name.startswith("decoder layer")]
    assert layer.count == base.count == 2
    # 7 projections, one LoRA program each, in the layer's graph
    assert sum(name.startswith("lora_sgmv") for name, _ in layer.kernels) == 7
    assert not any(name.startswith("lora_sgmv") for name, _ in base.kernels)
    # what the adapters cost is the step with them less the step without
    assert est.lora_s == pytest.approx(est.decode_s - plain.decode_s, rel=1e-9)
    lora_programs = sum(t for name, t in layer.kernels if name.startswith("lora_sgmv"))
    assert est.lora_s > layer.count * lora_programs * 0.5 > 0
    assert est.prefill_s == plain.prefill_s
    # the stacks: 4 slots x rank 16 x (in + out) of every projection, fp16
    dims = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 640), (256, 640), (640, 256)]
    stacks = 2 * 4 * 16 * sum(i + o for i, o in dims) * 2
    assert est.extra_weight_bytes - plain.extra_weight_bytes == stacks
    assert "LoRA:" in est.format()
