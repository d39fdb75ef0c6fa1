"""`spyre estimate` for any config: batch, tensor parallel (collectives from
the interconnect model), memory per card and "needs N cards", and the
serving plan through vLLM's scheduler (--serve)."""

from __future__ import annotations

import json

import pytest

from torch_spyre.models import estimate as E
from torch_spyre.models import parallel

# a config.json no built-in table knows: qwen3 with its own sizes
CONFIG = {
    "model_type": "qwen3", "vocab_size": 384, "hidden_size": 256, "intermediate_size": 640,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
PROMPT, NEW = 32, 16
_cache: dict = {}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(CONFIG))
    return str(p)


def _est(path: str, **kw) -> E.Estimate:
    key = tuple(sorted(kw.items()))
    if key not in _cache:
        cfg = parallel.load_config(path)
        _cache[key] = E.estimate(path, prompt=PROMPT, new_tokens=NEW, config=cfg, **kw)
    return _cache[key]


def test_tp2_plan_is_a_shard_plus_the_collectives(config_path):
    from torch_spyre.runtime import cards
    from torch_spyre.sim.interconnect import collective_time

    one, two = _est(config_path), _est(config_path, tp=2)
    assert one.params == two.model_params  # the whole model, counted alike
    # the shard: half the heads, intermediate and vocabulary; norms replicated
    assert one.params / 2 < two.params < one.params * 0.55
    assert two.kv_cache_bytes * 2 == one.kv_cache_bytes  # 2 KV heads -> 1 per card
    hw = cards.config()
    for phase, tokens in (("prefill", PROMPT), ("decode", 1)):
        parts = getattr(two, phase)
        (coll,) = [p for p in parts if p.name == "collectives (TP 2)"]
        hidden = tokens * 256 * 2  # fp16 hidden state
        ar = collective_time("all_reduce", hidden, 2, hw)
        ag = collective_time("all_gather", 192 * 2 * 2, 2, hw)  # logits, 384 vocab
        assert coll.time_s == pytest.approx(ar + 2 * 2 * ar + ag, rel=1e-12)
        assert two.collective_s[phase] == coll.time_s
    assert not any(p.name.startswith("collectives") for p in one.decode)
    # each card's layer is smaller: less modelled time per decode layer
    layer = lambda e: next(p for p in e.decode if p.name.startswith("decoder"))  # noqa: E731
    assert layer(two).time_s < layer(one).time_s
    assert "2 cards (tensor parallel" in two.format()


def test_batch_scales_kv_and_throughput(config_path):
    one, four = _est(config_path), _est(config_path, batch=4)
    assert four.kv_cache_bytes == 4 * one.kv_cache_bytes
    assert four.prefill_flops == pytest.approx(4 * one.prefill_flops)
    # decode reads the weights once for all four requests: well under 4x the time
    assert one.decode_s < four.decode_s < 2 * one.decode_s
    d = four.to_json()
    assert d["decode_tokens_per_s"] == pytest.approx(4 / four.decode_s)


def test_prefill_packs_prompts_into_the_token_budget(config_path):
    """vLLM's scheduler packs whole prompts into a step's token budget: four
    32-token prompts in a 128-token budget are one step of four requests,
    whose weights are read once, not four times."""
    assert E.prefill_batch(32, 512, 2048) == 4
    assert E.prefill_batch(6, 512, 2048) == 3  # a divisor of the batch: equal steps
    assert E.prefill_batch(4, 4096, 2048) == 1  # longer than the budget: whole
    with pytest.raises(ValueError, match="token budget"):
        E.prefill_batch(4, 32, 0)
    alone = _est(config_path, batch=4, token_budget=PROMPT)
    packed = _est(config_path, batch=4, token_budget=4 * PROMPT)
    assert (alone.prefill_batch, packed.prefill_batch) == (1, 4)
    assert packed.prefill_flops == alone.prefill_flops
    assert packed.decode_s == alone.decode_s
    layer = lambda e: next(p for p in e.prefill if p.name.startswith("decoder"))  # noqa: E731
    assert layer(alone).count == 4 * layer(packed).count
    assert packed.prefill_s < alone.prefill_s
    assert "prefill 4 requests per step (128-token budget)" in packed.format()


def test_does_not_fit_names_the_cards_needed(config_path, spyre_settings):
    one = _est(config_path)
    per = one.per_card_bytes
    assert sorted(per) == [1, 2, 4]  # 4 heads, 2 KV heads: valid splits
    assert per[1] > per[2] > per[4]
    # a card between the 2-card and the 1-card need
    spyre_settings(device_memory=str((per[1] + per[2]) // 2))
    small = E.estimate(
        config_path, prompt=PROMPT, new_tokens=NEW, config=parallel.load_config(config_path)
    )
    assert not small.fits and small.cards_needed == 2
    assert "does not fit: needs 2 cards (--tp 2)" in small.format()


def test_bad_tp_is_explained(config_path):
    cfg = parallel.load_config(config_path)
    with pytest.raises(ValueError, match="4 attention heads do not split over 3"):
        parallel.check_tp(cfg, 3)
    with pytest.raises(ValueError, match="1..8"):
        parallel.check_tp(cfg, 16)
    with pytest.raises(ValueError, match="no 'model_type'"):
        bad = config_path.replace("config.json", "bad.json")
        open(bad, "w").write("{}")
        parallel.load_config(bad)


def test_serve_plan_cli(config_path, tmp_path, capsys):
    """--serve: vLLM's scheduler over Poisson arrivals; under light load the
    server keeps up, past saturation it does not and TTFT grows."""
    from torch_spyre import cli

    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    argv = ["estimate", config_path, "--serve", "--rate", "20,100000", "--input-len", "32",
            "--output-len", "8", "--tp", "2", "--batch", "4", "--requests", "40",
            "--json", str(out), "--plot", str(png), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "TPOT p50" in text
    light, heavy = json.loads(out.read_text())
    assert light["tp"] == 2 and light["requests"] == 40
    # light load: served about as offered (Poisson: within 40% over 40 requests)
    assert 0.6 * 20 < light["throughput_requests_s"] < 1.4 * 20
    # saturated: far below 100000/s, and requests wait for a slot
    assert heavy["throughput_requests_s"] < 0.1 * 100000
    assert heavy["ttft_p99_s"] > 3 * light["ttft_p99_s"]
    # TPOT: at least the planned batch-1 decode step on 2 cards
    d1 = light["step_model"]["decode_1_s"]
    assert light["tpot_p50_s"] >= d1 * 0.999
    assert png.stat().st_size > 1000
