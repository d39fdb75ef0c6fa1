"""Start-up time of vLLM on the card against depth: one graph or piece by piece.

``python benchmarks/startup.py [--depths 2,8,40] [--smollm2] [--json F]``
``python benchmarks/startup.py --warm-cache [--depths ""]``: the README main
job's compile phase and ``vllm serve`` of SmolLM2 until ``/health`` answers,
each cold (an empty ``TORCH_SPYRE_CACHE_DIR``) and warm (the directory the
cold run filled), every run a fresh process (see ``warm_cache``).

For each model, ``vllm.LLM(...)`` is started in a fresh process twice with
one Inductor cache directory: **cold** (the directory empty) and **warm**
(filled by the cold run), with the forward compiled as one graph per
token bucket (``TORCH_SPYRE_VLLM_PIECEWISE=0``), piece by piece between
attention ops, each distinct piece compiled once (the default,
``compiler/piecewise.py``), and piece by piece traced flat: every layer and
every bucket traced by Dynamo (``TORCH_SPYRE_VLLM_REGIONS=0``; the default
traces the repeated layers once and the forward once for every bucket,
``compiler/regions.py``).  The start-up compiles every bucket (16, 32 and
the token budget, 64 here).  Each run then answers one 8-token request; its
modelled card time is printed beside (deterministic: the two modes must run
the same or fewer card cycles) and its tokens compared.

The models: a Granite-shaped decoder at small width (GraniteForCausalLM:
hidden 256, 4 heads, 2 KV heads, MLP 512, its residual and logit
multipliers) at each depth, random weights built here; with ``--smollm2``
SmolLM2-135M from the offline model store (30 layers).

``python benchmarks/startup.py --vs-cpu [--depths 2,8,40] [--smollm2]``: the
same models' forward (``torch.compile(model, fullgraph=True)``, no KV cache,
16 and 64 tokens: the two buckets above) compiled by the spyre backend and by
Inductor's own CPU backend, each cold (an empty cache directory) and warm
(the directory the cold run filled), every run a fresh process: the compile
time of a shape is its first call less its second.

``python benchmarks/startup.py --package``: a deployment that ships
SmolLM2-135M's decode step as an AOTInductor package (``torch.export`` +
``aoti_compile_and_package``, docs/compiler.md "Ahead-of-time packages"):
the time to build the package, then a fresh process's time to its first
decode step (import, ``aoti_load_package``, the first call) against the
README main job's warm compile phase (``--warm-cache``).

Wall-clock figures depend on the machine's load; compare the modes and the
backends in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from vllm import LLM, SamplingParams
path, dtype = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
          max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20, seed=0)
up = time.perf_counter() - t0
clock = torch.spyre.modelled_time_s()
out = llm.generate([{"prompt_token_ids": [1, 5, 9, 23, 42, 77, 101, 7]}],
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
modelled = torch.spyre.modelled_time_s() - clock
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
s = runner.compiled.summary()
print("STARTUP " + json.dumps({
    "up_s": up, "compile_s": sum(s["compile_s"].values()), "pieces": s["pieces"],
    "traces": s["traces"],
    "modelled_ms": modelled * 1e3, "tokens": list(out[0].outputs[0].token_ids),
}))
"""


def granite(depth: int, root: Path) -> str:
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    path = root / f"granite_{depth}"
    if not path.exists():
        torch.manual_seed(0)
        cfg = GraniteConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=depth,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True, residual_multiplier=0.22, embedding_multiplier=12.0,
            logits_scaling=8.0, attention_multiplier=0.0078125,
        )  # fmt: skip
        GraniteForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def child(code: str, args: list[str], env: dict, tag: str, what: str, timeout: float) -> dict:
    """``code`` in a fresh interpreter; the JSON it printed after ``tag``, and
    ``process_s``, the process's wall time."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=timeout)  # fmt: skip
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(tag + " ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{p.stderr[-3000:]}")
    out = json.loads(line.removeprefix(tag + " "))
    out["process_s"] = time.perf_counter() - t0
    return out


#: (label, TORCH_SPYRE_VLLM_PIECEWISE, TORCH_SPYRE_VLLM_REGIONS)
MODES = (
    ("one graph", False, True),
    ("piece by piece", True, True),
    ("piece by piece, flat trace", True, False),
)


def run(path: str, dtype: str, piecewise: bool, cache: str, regions: bool = True) -> dict:
    env = {
        **os.environ,
        # cold is cold: Inductor's cache and our kernel searches (a run after
        # another would find the searches of the one before)
        "TORCHINDUCTOR_CACHE_DIR": cache,
        "TORCH_SPYRE_CACHE_DIR": cache,
        "TORCH_SPYRE_VLLM_PIECEWISE": "1" if piecewise else "0",
        "TORCH_SPYRE_VLLM_REGIONS": "1" if regions else "0",
        "TORCH_SPYRE_VLLM_LOG_STEPS": "0",
    }
    return child(CHILD, [path, dtype], env, "STARTUP", f"{path} (piecewise={piecewise})", 1800)


#: the README main job (examples/chat.py) up to its answer, timed by phase
MAIN_JOB = r"""
import json, os, time
t0 = time.perf_counter()
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, torch_spyre
from torch._dynamo.utils import compilation_time_metrics, counters
from torch_spyre import models
from torch_spyre.models.generate import generate, prompt_ids
from torch_spyre.compiler import precompiled
from torch_spyre.runtime import artifact_cache
tok = models.load_tokenizer("smollm2")
dev = models.prepare(models.load_reference("smollm2", kind="causal-lm"),
                     dtype=torch.float16, compile=True)
ids = prompt_ids(tok, "What is the capital of France? Answer in one sentence.")
loaded = time.perf_counter() - t0
out = generate(dev, ids, 32, eos_token_id=tok.eos_token_id)
steady = sorted(out.decode_wall_s[1:]) or [0.0]
step = steady[len(steady) // 2]
print("MAINJOB " + json.dumps({
    "import_load_s": loaded,
    # the first prefill and the first decode step, less one step of each run
    "compile_s": out.prefill_wall_s + out.decode_wall_s[0] - 2 * step,
    "prefill_wall_s": out.prefill_wall_s, "first_decode_s": out.decode_wall_s[0],
    "step_s": step, "tokens": out.tokens[0].tolist(),
    "dynamo_s": {k: sum(v) for k, v in compilation_time_metrics.items()},
    "aot_autograd": dict(counters["aot_autograd"]), "inductor": dict(counters["inductor"]),
    "spyre_cache": artifact_cache.stats.as_dict(),
    "precompiled": {k: v for k, v in precompiled.summary(dev).items() if k != "why"},
}))
"""


#: one model's forward compiled on one device (spyre or Inductor's CPU backend)
DIRECT = r"""
import json, os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, transformers
path, device = sys.argv[1], sys.argv[2]
if device == "spyre":
    import torch_spyre  # noqa: F401
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
model = model.eval().to(device)
fn = torch.compile(model, fullgraph=True, dynamic=False)
gen = torch.Generator().manual_seed(0)
compile_s = {}
for tokens in (16, 64):
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen).to(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(input_ids=ids, use_cache=False).logits.cpu()
        t1 = time.perf_counter()
        fn(input_ids=ids, use_cache=False).logits.cpu()
        t2 = time.perf_counter()
    compile_s[tokens] = (t1 - t0) - (t2 - t1)
from torch._dynamo.utils import counters
print("DIRECT " + json.dumps({"compile_s": sum(compile_s.values()), "by_tokens": compile_s,
                             "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def direct(path: str, device: str, cache: str) -> dict:
    """``DIRECT`` in a fresh process with this cache directory (Inductor's for
    the CPU backend; torch_spyre's, which holds Inductor's, for spyre)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if device == "spyre":
        env["TORCH_SPYRE_CACHE_DIR"] = cache
    else:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    return child(DIRECT, [path, device], env, "DIRECT", f"{path} on {device}", 3600)


def vs_cpu(models: list[tuple[str, str, str]], tmp: str, json_out: str | None) -> int:
    """Cold and warm compile time of each model's forward, spyre against
    Inductor's CPU backend (issue 30, item 5)."""
    rows = []
    for name, path, _ in models:
        row: dict = {"model": name}
        for device in ("spyre", "cpu"):
            cache = tempfile.mkdtemp(prefix=f"{device}_", dir=tmp)
            row[device] = {"cold": direct(path, device, cache), "warm": direct(path, device, cache)}
        rows.append(row)
        print(f"{name:14} spyre cold {row['spyre']['cold']['compile_s']:6.1f} s warm "
              f"{row['spyre']['warm']['compile_s']:5.1f} s | cpu cold "
              f"{row['cpu']['cold']['compile_s']:6.1f} s warm {row['cpu']['warm']['compile_s']:5.1f} s",
              flush=True)  # fmt: skip
    print()
    print(
        "| model | spyre cold (s) | spyre warm (s) | Inductor CPU cold (s) | CPU warm (s) | cold, spyre / CPU |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        sc, sw = r["spyre"]["cold"]["compile_s"], r["spyre"]["warm"]["compile_s"]
        cc, cw = r["cpu"]["cold"]["compile_s"], r["cpu"]["warm"]["compile_s"]
        print(f"| {r['model']} | {sc:.1f} | {sw:.1f} | {cc:.1f} | {cw:.1f} | {sc / cc:.2f} |")
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))
    return 0


def main_job(cache: str) -> dict:
    """The main job's compile phase in a fresh process with this cache directory."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TORCH_SPYRE_CACHE_DIR"] = cache
    return child(MAIN_JOB, [], env, "MAINJOB", "the main job", 1800)


def serve_ready(cache: str, port: int, timeout_s: float = 900.0) -> dict:
    """Seconds from starting ``vllm serve`` (SmolLM2, the docs' flags) until
    ``/health`` answers 200; the server is stopped after."""
    import signal
    import urllib.error
    import urllib.request

    from torch_spyre.models.offline import folder

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TORCH_SPYRE_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
    cmd = ["vllm", "serve", str(folder("smollm2")), "--served-model-name", "smollm2",
           "--dtype", "float16", "--max-model-len", "2048", "--max-num-seqs", "16",
           "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", "256M",
           "--port", str(port)]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="spyre_serve_", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read()[-3000:]}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(
                    f"vllm serve not healthy after {timeout_s:.0f} s (log {log.name})"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        ready = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log.seek(0)
    text = log.read()
    warm = [ln.split("spyre: ", 1)[1] for ln in text.splitlines() if "spyre: warm-up" in ln]
    return {"ready_s": ready, "warmup": warm, "log": log.name}


def warm_cache(json_out: str | None) -> int:
    """The README main job's compile phase and ``vllm serve`` ready time, cold
    and warm, one fresh cache directory each (issue 30: under 5 s and 15 s)."""
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="spyre_cache_") as tmp:
        cache = str(Path(tmp) / "main")
        rows["main_cold"] = main_job(cache)
        rows["main_warm"] = main_job(cache)
        for k in ("main_cold", "main_warm"):
            r = rows[k]
            top = sorted(r["dynamo_s"].items(), key=lambda kv: -kv[1])[:4]
            print(f"{k}: compile phase {r['compile_s']:.1f} s (prefill {r['prefill_wall_s']:.1f} s, "
                  f"first decode {r['first_decode_s']:.1f} s), load {r['import_load_s']:.1f} s; "
                  f"{', '.join(f'{n} {t:.1f} s' for n, t in top)}; spyre cache "
                  f"{r['spyre_cache']}; precompiled forward {r['precompiled']}",
                  flush=True)  # fmt: skip
        same = rows["main_cold"]["tokens"] == rows["main_warm"]["tokens"]
        print(f"main job: the same tokens cold and warm: {'yes' if same else 'NO'}")
        cache = str(Path(tmp) / "serve")
        for k in ("serve_cold", "serve_warm"):
            rows[k] = serve_ready(cache, port=18431)
            print(f"{k}: /health OK after {rows[k]['ready_s']:.1f} s; {rows[k]['warmup']}",
                  flush=True)  # fmt: skip
    print()
    print("| what | cold (s) | warm (s) | target warm (s) |")
    print("|---|---|---|---|")
    print(f"| main job compile phase | {rows['main_cold']['compile_s']:.1f} | "
          f"{rows['main_warm']['compile_s']:.1f} | 5 |")  # fmt: skip
    print(f"| vllm serve SmolLM2 ready | {rows['serve_cold']['ready_s']:.1f} | "
          f"{rows['serve_warm']['ready_s']:.1f} | 15 |")  # fmt: skip
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))
    return 0


PACKAGE_BUILD = r"""
import json, sys, time
import torch
from transformers import GenerationConfig
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache
from torch_spyre import models
model = models.load("smollm2", device="spyre", dtype=torch.float16)
model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static",
    max_length=64, cache_config={"batch_size": 1, "max_cache_len": 64})
step = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=64)
t0 = time.perf_counter()
ep = torch.export.export(step, (), {"input_ids": torch.tensor([[1]]).to("spyre"),
    "cache_position": torch.tensor([0]).to("spyre")}, strict=True)
t1 = time.perf_counter()
torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1])
t2 = time.perf_counter()
print("PACKAGE " + json.dumps({"export_s": t1 - t0, "package_s": t2 - t1}))
"""

PACKAGE_LOAD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
run = torch._inductor.aoti_load_package(sys.argv[1])
t2 = time.perf_counter()
ids, pos = torch.tensor([[1]]).to("spyre"), torch.tensor([0]).to("spyre")
first = run(input_ids=ids, cache_position=pos)[0, -1].argmax().item()
t3 = time.perf_counter()
print("LOADED " + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_step_s": t3 - t2,
    "first_s": t3 - t0, "token": first, "bytes": os.path.getsize(sys.argv[1])}))
"""


def package_start(json_out: str | None) -> int:
    """SmolLM2's decode step built into a .pt2, then loaded by fresh processes."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="spyre_pt2_") as tmp:
        path = str(Path(tmp) / "smollm2_decode.pt2")
        env["TORCH_SPYRE_CACHE_DIR"] = str(Path(tmp) / "cache")
        built = child(PACKAGE_BUILD, [path], env, "PACKAGE", "building the package", 1800)
        loads = [child(PACKAGE_LOAD, [path], env, "LOADED", "loading the package", 600)
                 for _ in range(2)]  # fmt: skip
    print("| what | s |")
    print("|---|---|")
    print(f"| torch.export of the decode step | {built['export_s']:.1f} |")
    print(f"| aoti_compile_and_package ({loads[0]['bytes'] / 1e6:.0f} MB) | "
          f"{built['package_s']:.1f} |")  # fmt: skip
    for i, r in enumerate(loads):
        print(f"| fresh process {i + 1}: import {r['import_s']:.1f} + load {r['load_s']:.1f} + "
              f"first step {r['first_step_s']:.1f} | {r['first_s']:.1f} |")  # fmt: skip
    same = len({r["token"] for r in loads}) == 1
    print(f"\nthe same first token in both processes: {'yes' if same else 'NO'}")
    if json_out:
        Path(json_out).write_text(json.dumps({"build": built, "loads": loads}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="2,8,40")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (offline store)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-cache", action="store_true",
                    help="the main job's compile phase and vllm serve's ready time, cold and warm")  # fmt: skip
    ap.add_argument("--vs-cpu", action="store_true",
                    help="the forward's compile time, spyre against Inductor's CPU backend")  # fmt: skip
    ap.add_argument("--package", action="store_true",
                    help="SmolLM2's decode step shipped as an AOTInductor package")  # fmt: skip
    args = ap.parse_args(argv)
    if args.package:
        return package_start(args.json)
    if args.warm_cache:
        return warm_cache(args.json)
    rows = []
    with tempfile.TemporaryDirectory(prefix="spyre_startup_") as tmp:
        models = [(f"granite x{d}", granite(int(d), Path(tmp)), "float16")
                  for d in args.depths.split(",")]  # fmt: skip
        if args.smollm2:
            from torch_spyre.models.offline import folder

            models.append(("SmolLM2-135M", str(folder("smollm2")), "float16"))
        if args.vs_cpu:
            return vs_cpu(models, tmp, args.json)
        for name, path, dtype in models:
            for mode, piecewise, regions in MODES:
                cache = tempfile.mkdtemp(prefix="inductor_", dir=tmp)
                cold = run(path, dtype, piecewise, cache, regions)
                warm = run(path, dtype, piecewise, cache, regions)
                rows.append({"model": name, "mode": mode, "piecewise": piecewise,
                             "regions": regions, "cold": cold, "warm": warm})  # fmt: skip
                print(
                    f"{name:14} {mode:26} cold {cold['up_s']:6.1f} s "
                    f"warm {warm['up_s']:6.1f} s  compile {cold['compile_s']:5.1f} s  "
                    f"traces {cold['traces']}  pieces {cold['pieces']}  "
                    f"{cold['modelled_ms']:.3f} ms modelled",
                    flush=True,
                )
    print()
    print(
        "| model | mode | engine up cold (s) | warm (s) | compile cold (s) | Dynamo traces | pieces compiled / reused | modelled ms, 8 tokens | same tokens |"
    )  # noqa: E501
    print("|---|---|---|---|---|---|---|---|---|")
    whole = {r["model"]: r for r in rows if r["mode"] == "one graph"}
    for r in rows:
        c, pcs = r["cold"], r["cold"]["pieces"]
        same = c["tokens"] == whole[r["model"]]["cold"]["tokens"]
        pieces = f"{pcs['compiled']} / {pcs['reused']}" if r["piecewise"] else "-"
        print(
            f"| {r['model']} | {r['mode']} | {c['up_s']:.1f} | {r['warm']['up_s']:.1f} | "
            f"{c['compile_s']:.1f} | {c['traces']} | {pieces} | {c['modelled_ms']:.3f} | "
            f"{'yes' if same else 'NO'} |"
        )
    for mode in ("piece by piece", "piece by piece, flat trace"):
        depths = [r for r in rows if r["mode"] == mode and r["model"].startswith("granite")]
        if len(depths) >= 2:
            lo, hi = depths[0], depths[-1]
            print(
                f"\n{mode}, cold compile: {hi['model']} {hi['cold']['compile_s']:.1f} s against "
                f"{lo['model']} {lo['cold']['compile_s']:.1f} s "
                f"({hi['cold']['compile_s'] / lo['cold']['compile_s']:.2f}x; issue 30's bar: 1.5x)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
