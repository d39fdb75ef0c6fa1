"""The architecture sweep: tiny configs of every type, the runner's verdicts,
resuming, the table; the CI sample end to end (slow)."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from torch_spyre.tools.archsweep import configs, run, sweep, table


def test_every_model_type_is_listed_with_its_family():
    types = configs.model_types()
    names = [m.name for m in types]
    assert len(names) == len(set(names)) >= 150
    fam = {m.name: m.family for m in types}
    assert fam["llama"] == "causal-lm" and fam["distilbert"] == "encoder"
    assert set(sweep.CI_SAMPLE) <= set(names)


def test_tiny_configs_keep_each_architecture_and_shrink_it():
    cfg = configs.tiny_config("llama")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.vocab_size == 256 and cfg.intermediate_size == 128
    # multi-query attention stays multi-query; the class derives the rest
    falcon = configs.tiny_config("falcon")
    assert falcon.multi_query and falcon.hidden_size == 64
    # a hybrid keeps one layer of each kind
    hybrid = configs.tiny_config("qwen3_next")
    assert set(hybrid.layer_types) == {"linear_attention", "full_attention"}
    assert hybrid.num_hidden_layers == len(hybrid.layer_types)
    # token ids stay inside the shrunk vocabulary
    for name in ("gpt2", "bloom", "opt"):
        c = configs.tiny_config(name)
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(c, tok, None)
            assert v is None or isinstance(v, list) or v < c.vocab_size


def test_wide_configs_have_heads_the_attention_fusions_take():
    """``--wide``: heads of 64 (half a head one fp32 stick) at width 256,
    everything else as the tiny config; the tiny config is unchanged."""
    wide = configs.tiny_config("llama", hidden=configs.WIDE_HIDDEN)
    assert (wide.hidden_size, wide.num_attention_heads, wide.head_dim) == (256, 4, 64)
    assert wide.intermediate_size == 512 and wide.num_hidden_layers == 2
    assert configs.tiny_config("llama").head_dim == 16


@pytest.mark.parametrize("name", ["llama", "helium", "glm_moe_dsa"])
def test_a_wide_model_compiles_its_attention_half_into_one_program(name):
    """A wide model at 64 tokens through the sweep's runner: eager and
    compiled match the CPU.  Llama's prefill runs the norm, Q, K, V, RoPE
    and head split as one program per layer (the launch cache holds it).
    Helium's interleaved rotary is lane steps that view a negated slice of
    the head split in its token-major strides, GLM-MoE-DSA's indexer views
    a split of it: those outputs stay token-major (the `--wide` sweep found
    both compiles raising when they did not: a pointwise op's and a split's
    output strides follow their input's)."""
    from torch_spyre.runtime import launch

    launch.clear_cache()
    (mt,) = [m for m in configs.model_types() if m.name == name]
    row = run.run_type(mt, compile=True, wide=True)
    assert row.status == "ok" and row.mode == "decode", row
    assert (row.eager.verdict, row.compiled.verdict) == ("match", "match"), row
    fused = [
        k[-1] for k in launch._cache if isinstance(k, tuple) and k and k[0] == "norm_projections"
    ]
    if name == "llama":
        assert fused and all(h is not None and any(h.rope) and all(h.first) for h in fused)
    elif name == "helium":
        assert all(h is None or not any(h.rope) for h in fused), fused


def test_layer_pattern_keeps_every_kind():
    assert configs._layer_pattern(["a"] * 5 + ["b"] + ["a"] * 3, 2) == ["a", "a", "b"]
    assert configs._layer_pattern(["a", "b", "a", "b"], 2) == ["a", "b"]


def _ref(mode, outs, tokens=None):
    return run.Reference(mode, outs, tokens)


def test_compare_flags_a_wrong_step_and_a_wrong_token_but_not_rounding():
    torch.manual_seed(0)
    steps = [torch.randn(1, 256) * 3 for _ in range(3)]
    res = run.PathResult()
    run._compare(_ref("decode", steps), [s + 1e-6 for s in steps], res)
    assert res.verdict == "match" and res.token_flips == 0
    # the third step's logits drift by a tenth of their scale (a stale cache row)
    bad = [s.clone() for s in steps]
    bad[2] += 0.3 * torch.randn(1, 256)
    run._compare(_ref("decode", steps), bad, res)
    assert res.verdict == "mismatch"
    # a flipped argmax: counted; a near-tie within the tolerance is a match
    flip = [s.clone() for s in steps]
    top2 = steps[1].topk(2).indices[0]
    flip[1][0, top2[1]] = steps[1][0, top2[0]] + 1e-4
    gap = float(steps[1][0, top2[0]] - steps[1][0, top2[1]])
    run._compare(_ref("decode", steps), flip, res)
    assert res.token_flips == 1
    assert res.verdict == ("match" if gap < 1e-3 * 3 else "mismatch")
    # NaN is never a match
    run._compare(_ref("forward", steps[:1]), [torch.full((1, 256), float("nan"))], res)
    assert res.verdict == "mismatch"


def test_a_type_that_does_not_run_on_the_cpu_is_a_cpu_error_row(monkeypatch):
    def broken(mt, variant=0, wide=False):
        raise ValueError(f"bad default config {variant}")

    monkeypatch.setattr(run, "build", broken)
    row = run.run_type(configs.ModelType("llama", "causal-lm", "LlamaForCausalLM"))
    assert row.status == "cpu-error" and "bad default config 1" in row.error


def test_rows_round_trip_and_the_table_counts_them(tmp_path):
    good = run.Row("llama", "causal-lm", mode="decode")
    good.eager = run.PathResult("match", 1e-7, 1.0)
    good.compiled = run.PathResult("match", 2e-7, 1.0, modelled_ms_per_token=0.1)
    wrong = run.Row("olmoe", "causal-lm", mode="decode")
    wrong.eager = run.PathResult("match", 1e-7, 1.0)
    wrong.compiled = run.PathResult("mismatch", 0.5, 1.0, degraded={"eager": 1})
    cpu = run.Row("odd", "encoder", status="cpu-error", error="ValueError: x")
    out = tmp_path / "r.jsonl"
    for r in (good, wrong, cpu):
        sweep._append(out, r)
    rows = sweep.load(out)
    assert rows["olmoe"].compiled.degraded == {"eager": 1}
    t = table.totals(list(rows.values()))
    assert (t.types, t.runs_on_cpu, t.eager_match, t.compiled_match) == (3, 2, 2, 1)
    assert (t.compiled_clean, t.wrong, t.aborted) == (1, 1, 0)
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n\nintro\n")
    table.write_doc(list(rows.values()), doc)
    table.write_doc(list(rows.values()), doc)  # replaces its section
    text = doc.read_text()
    assert text.count(table.BEGIN) == 1 and text.startswith("# Models")
    assert "| olmoe | causal-lm | decode | match | mismatch | 5.0e-01 |" in text


def test_the_sweep_resumes_and_records_a_timeout(tmp_path, monkeypatch):
    """A type already in the results is not run again; a worker stuck past the
    timeout is killed and its type gets a timeout row."""
    out = tmp_path / "r.jsonl"
    done = run.Row("llama", "causal-lm", mode="decode")
    sweep._append(out, done)
    types = sweep.selected(["llama", "mistral"])
    # a worker that starts its first type and hangs
    hang = (
        "import sys, time; a = sys.argv; p = a[a.index('--progress') + 1]; "
        "t = a[a.index('--types') + 1].split(',')[0]; "
        "open(p, 'w').write(f'{t} {time.time()}'); time.sleep(600)"
    )
    monkeypatch.setattr(sweep, "WORKER", [sys.executable, "-c", hang])
    t0 = time.time()
    rows = sweep.sweep(types, out, jobs=1, timeout=2.0, echo=lambda s: None)
    assert time.time() - t0 < 120
    assert json.dumps(rows["llama"].to_dict()) == json.dumps(done.to_dict())
    assert rows["mistral"].status == "timeout"
    assert [json.loads(line)["type"] for line in out.read_text().splitlines()] == [
        "llama",
        "mistral",
    ]


@pytest.mark.slow
def test_ci_sample_of_the_sweep(tmp_path):
    """The fixed CI sample (dense, MoE, hybrid, latent attention, encoders):
    no type that runs on the CPU gives a wrong answer or aborts its compile;
    eager and compiled match on all but the listed gaps."""
    t0 = time.perf_counter()
    rows = sweep.sweep(sweep.selected(sample="ci"), tmp_path / "ci.jsonl", jobs=2, timeout=600)
    wall = time.perf_counter() - t0
    ok = [r for r in rows.values() if r.status == "ok"]
    lines = "\n".join(sweep._line(r) for r in rows.values())
    assert len(rows) == len(sweep.CI_SAMPLE), lines
    assert len(ok) >= len(sweep.CI_SAMPLE) - 2, lines
    assert not [r.type for r in ok if "mismatch" in (r.eager.verdict, r.compiled.verdict)], lines
    assert not [r.type for r in ok if r.compiled.verdict == "error"], lines
    assert not [r.type for r in ok if r.eager.verdict != "match"], lines
    print(f"\nCI sample: {len(rows)} types in {wall:.0f} s\n{lines}")


def test_a_row_being_written_or_cut_off_is_not_read(tmp_path):
    """The parent reads the results while a worker writes them: a last line
    without its newline is not a row yet, and a line a killed worker left
    unfinished is skipped (that type runs again), never a JSON error."""
    out = tmp_path / "r.jsonl"
    sweep._append(out, run.Row("llama", "causal-lm", mode="decode"))
    whole = json.dumps(run.Row("gpt2", "causal-lm", mode="decode").to_dict())
    with out.open("a") as f:
        f.write(whole[: len(whole) // 2])  # mid-write
    assert set(sweep.load(out)) == {"llama"}
    sweep._append(out, run.Row("qwen3", "causal-lm", mode="decode"))  # after a kill
    assert set(sweep.load(out)) == {"llama", "qwen3"}
    assert out.read_text().count("\n") == 3
