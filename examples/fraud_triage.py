"""IBM's reference use case on the simulated spyre card: an insurer triages claims.

Stage 1, classic models: a synthetic, seeded claims data set (tabular claim
features plus each claimant's recent transaction sequence, with planted fraud
patterns and ground-truth labels); a small scorer (an MLP over the tabular
features plus an LSTM over the sequence) is trained on the CPU in seconds,
then scores every claim on the card, batched and compiled (``torch.compile``
on the spyre device).  Printed: the card's scores against the CPU's (max
difference), host fallbacks (must be 0), precision and recall on the
held-out claims, and the modelled card time per batch.

Stage 2, an LLM on the card: the flagged claims go to a chat model served by
vLLM with our platform plugin, through vLLM's OpenAI-compatible API
(``vllm serve`` in a subprocess), which answers each with a JSON verdict and
reasons under a JSON schema (structured outputs, ``response_format``
``json_schema``).  SmolLM2-135M-Instruct (offline weights) stands in for the
real model (Gemma 4 26B-A4B: see ``spyre estimate gemma-4-26b-a4b``).
``--offline`` uses vLLM's offline ``LLM`` API instead of the HTTP server.

Cards for a load: how many cards ``--claims-per-second`` needs with the real
LLM (Gemma 4 26B-A4B, Granite-3.3-8B), from ``spyre estimate --serve`` plans
at stage 2's request lengths and stage 1's flagged share, and a PNG of
claims/s against cards (``--plot``).

    python examples/fraud_triage.py [--claims 2000] [--flagged 5] [--offline] [--no-llm]
                                    [--claims-per-second 5] [--serve-tp 1,2] [--no-cards]

docs/use-case.md has the pipeline, a measured run and what is modelled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torch_spyre  # noqa: E402
from torch_spyre.runtime import dispatch_stats  # noqa: E402

# ------------------------------------------------------------------ the data set
TAB_FEATURES = (
    "log claim amount",
    "policy age (log days)",
    "claimant age / 100",
    "prior claims",
    "days since last claim (log)",
    "amount / last claim amount",
    "claims on the same policy this year",
    "adjuster-flagged documents",
)
SEQ_FEATURES = ("log amount", "log hours since previous", "online", "foreign")
PATTERNS = ("duplicate claim", "claim soon after policy start", "transaction burst")


@dataclass
class Claims:
    tab: torch.Tensor  # [N, 8] float32
    seq: torch.Tensor  # [N, T, 4] float32
    label: torch.Tensor  # [N] float32, 1 = fraud
    pattern: list[list[str]]  # planted patterns per claim (empty: legitimate)
    raw: list[dict]  # human-readable facts per claim (for the LLM)


def make_claims(n: int, steps: int, seed: int, fraud_rate: float = 0.12) -> Claims:
    """``n`` claims; a ``fraud_rate`` share carry one or two planted patterns.

    Legitimate claims sometimes look like one pattern in part (a new policy
    with an ordinary claim, a busy week of card use), so the task is not
    separable by one feature."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.rand(*shape, generator=g)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    fraud = rnd(n) < fraud_rate
    amount = torch.exp(7.0 + 0.8 * randn(n))  # ~1,100 median
    policy_days = torch.exp(5.5 + 1.0 * randn(n)).clamp(min=1.0)  # ~250 days median
    age = (45 + 13 * randn(n)).clamp(18, 90)
    prior = torch.poisson(torch.full((n,), 0.6), generator=g)
    since_last = torch.exp(5.0 + 1.0 * randn(n)).clamp(min=1.0)
    last_amount = amount * torch.exp(0.6 * randn(n))
    same_year = torch.poisson(torch.full((n,), 0.3), generator=g)
    docs = (rnd(n) < 0.05).float()
    # transaction sequences: ordinary spending, hours apart
    t_amount = 3.5 + 0.9 * randn(n, steps)
    t_gap = 3.0 + 1.0 * randn(n, steps)
    t_online = (rnd(n, steps) < 0.3).float()
    t_foreign = (rnd(n, steps) < 0.05).float()

    patterns: list[list[str]] = [[] for _ in range(n)]
    for i in torch.nonzero(fraud).flatten().tolist():
        k = 1 + int(rnd(1).item() < 0.35)
        chosen = torch.randperm(len(PATTERNS), generator=g)[:k].tolist()
        # the duplicate last: its prior claim copies the final claimed amount
        for c in sorted(chosen, key=(1, 2, 0).index):
            patterns[i].append(PATTERNS[c])
            if c == 0:  # the same loss claimed again: same amount, days later
                prior[i] += 1
                last_amount[i] = amount[i] * (1 + 0.01 * randn(1).item())
                since_last[i] = 1 + 6 * rnd(1).item()
                same_year[i] += 1
            elif c == 1:  # a claim within weeks of the policy start
                policy_days[i] = 2 + 25 * rnd(1).item()
                amount[i] *= 1.5 + rnd(1).item()
            else:  # a burst of large, rapid, online / foreign transactions at the end
                b = 5 + int(rnd(1).item() * 4)
                t_amount[i, -b:] = 5.5 + 0.6 * randn(b)
                t_gap[i, -b:] = -1.0 + 0.5 * randn(b)
                t_online[i, -b:] = (rnd(b) < 0.85).float()
                t_foreign[i, -b:] = (rnd(b) < 0.5).float()
        docs[i] = float(rnd(1).item() < 0.25)
    # look-alikes among the legitimate claims
    legit = torch.nonzero(~fraud).flatten()
    for i in legit[rnd(len(legit)) < 0.04].tolist():
        policy_days[i] = 5 + 40 * rnd(1).item()  # a new policy, an ordinary claim
    for i in legit[rnd(len(legit)) < 0.04].tolist():
        b = 3 + int(rnd(1).item() * 3)  # a busy few days, ordinary amounts
        t_gap[i, -b:] = 0.5 + 0.5 * randn(b)
        t_online[i, -b:] = 1.0

    tab = torch.stack(
        [
            amount.log(),
            policy_days.log(),
            age / 100,
            prior,
            since_last.log(),
            amount / last_amount,
            same_year,
            docs,
        ],
        dim=1,
    )
    seq = torch.stack([t_amount, t_gap, t_online, t_foreign], dim=2)
    raw = []
    for i in range(n):
        last = seq[i, -6:]
        raw.append(
            {
                "claim_amount": round(float(amount[i]), 2),
                "policy_age_days": int(policy_days[i]),
                "claimant_age": int(age[i]),
                "prior_claims": int(prior[i]),
                "days_since_last_claim": int(since_last[i]),
                "last_claim_amount": round(float(last_amount[i]), 2),
                "last_6_transactions": [
                    {
                        "amount": round(math.exp(float(t[0])), 2),
                        "hours_since_previous": round(math.exp(float(t[1])), 1),
                        "online": bool(t[2] > 0.5),
                        "foreign": bool(t[3] > 0.5),
                    }
                    for t in last
                ],
            }
        )
    return Claims(tab.float(), seq.float(), fraud.float(), patterns, raw)


# -------------------------------------------------------------------- the scorer
class ClaimScorer(nn.Module):
    """MLP over the tabular features + LSTM over the transaction sequence."""

    def __init__(self, n_tab: int, n_seq: int, hidden: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(n_tab, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.lstm = nn.LSTM(n_seq, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        # input standardisation, fitted on the training claims
        self.register_buffer("tab_mean", torch.zeros(n_tab))
        self.register_buffer("tab_std", torch.ones(n_tab))
        self.register_buffer("seq_mean", torch.zeros(n_seq))
        self.register_buffer("seq_std", torch.ones(n_seq))

    def forward(self, tab: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        a = self.mlp((tab - self.tab_mean) / self.tab_std)
        _, (h, _) = self.lstm((seq - self.seq_mean) / self.seq_std)
        return torch.sigmoid(self.head(torch.cat([a, h[-1]], dim=1))).squeeze(1)


def train(data: Claims, idx: torch.Tensor, epochs: int, seed: int) -> ClaimScorer:
    torch.manual_seed(seed)
    model = ClaimScorer(data.tab.shape[1], data.seq.shape[2])
    tab, seq, y = data.tab[idx], data.seq[idx], data.label[idx]
    model.tab_mean.copy_(tab.mean(0))
    model.tab_std.copy_(tab.std(0).clamp(min=1e-3))
    model.seq_mean.copy_(seq.mean((0, 1)))
    model.seq_std.copy_(seq.std((0, 1)).clamp(min=1e-3))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    pos_weight = (1 - y.mean()) / y.mean().clamp(min=1e-3)
    for _ in range(epochs):
        for b in torch.randperm(len(idx), generator=g).split(128):
            p = model(tab[b], seq[b]).clamp(1e-6, 1 - 1e-6)
            w = torch.where(y[b] > 0.5, pos_weight, torch.ones(()))
            loss = (w * nn.functional.binary_cross_entropy(p, y[b], reduction="none")).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def score_on_card(
    model: ClaimScorer, data: Claims, batch: int, dtype: torch.dtype, whole_graph: bool = True
) -> tuple[torch.Tensor, dict]:
    """Every claim's score on the card, compiled, in batches of ``batch`` (the
    last one padded: one compiled shape).  Returns the scores and the stats.

    ``whole_graph``: Dynamo traces the LSTM too (``allow_rnn``): the scorer is
    one compiled graph (the recurrence unrolled into per-step matmul and gate
    programs).  Otherwise Dynamo's default: the graph breaks at the LSTM, which
    runs as the device's recurrent programs (ops/recurrent.py) between them."""
    dev_model = ClaimScorer(data.tab.shape[1], data.seq.shape[2])
    dev_model.load_state_dict(model.state_dict())
    dev_model = dev_model.to(device="spyre", dtype=dtype).eval()
    fn = torch.compile(dev_model, dynamic=False)
    rnn = torch._dynamo.config.patch(allow_rnn=whole_graph)
    n = data.tab.shape[0]
    torch_spyre.set_fallback_policy("silent")  # counted and reported below
    torch_spyre.reset_fallback_counts()
    dispatch_stats.reset()
    scores, times, walls = [], [], []
    with torch.no_grad(), rnn:
        for start in range(0, n, batch):
            tab = data.tab[start : start + batch]
            seq = data.seq[start : start + batch]
            rows = tab.shape[0]
            if rows < batch:  # pad to the compiled batch
                tab = torch.cat([tab, tab[-1:].expand(batch - rows, -1)])
                seq = torch.cat([seq, seq[-1:].expand(batch - rows, -1, -1)])
            w = time.perf_counter()
            torch.spyre.synchronize()
            clock = torch.spyre.modelled_time_s()
            out = fn(tab.to("spyre", dtype), seq.to("spyre", dtype)).float().cpu()
            torch.spyre.synchronize()
            times.append(torch.spyre.modelled_time_s() - clock)
            walls.append(time.perf_counter() - w)
            scores.append(out[:rows])
    falls = torch_spyre.fallback_counts()
    stats = {
        "batches": len(times),
        # the first batch compiles; its modelled time is the same program's
        "modelled_s_per_batch": sorted(times)[len(times) // 2],
        "modelled_s_total": sum(times),
        "wall_s_first_batch": walls[0],
        "wall_s_per_batch_warm": sorted(walls[1:])[len(walls[1:]) // 2] if len(walls) > 1 else 0,
        "host_fallbacks": sum(int(v) for v in falls.values()),
        "fallback_ops": dict(falls),
        "paths": {p: sum(dispatch_stats.counts(p).values()) for p in dispatch_stats.PATHS},
        "kernel_ops": dispatch_stats.counts("kernel"),
    }
    return torch.cat(scores), stats


def precision_recall(pred: torch.Tensor, label: torch.Tensor) -> tuple[float, float]:
    tp = float(((pred > 0.5) & (label > 0.5)).sum())
    fp = float(((pred > 0.5) & (label < 0.5)).sum())
    fn = float(((pred < 0.5) & (label > 0.5)).sum())
    return tp / max(tp + fp, 1.0), tp / max(tp + fn, 1.0)


# --------------------------------------------------------------- stage 2: the LLM
VERDICT_SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["fraud", "legitimate", "needs_review"]},
        "risk": {"type": "integer", "minimum": 0, "maximum": 10},
        # the fraud signs it sees, from the patterns the data set plants
        "signals": {
            "type": "array",
            "items": {"type": "string", "enum": [*PATTERNS, "none"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "reasons": {
            "type": "array",
            "items": {"type": "string", "maxLength": 80},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["verdict", "risk", "signals", "reasons"],
    "additionalProperties": False,
}
SYSTEM = (
    "You are an insurance fraud analyst. A screening model flagged the claim below. "
    "Fraud signs: the same amount claimed again within days, a claim within a month "
    "of the policy start, a burst of large, rapid, online or foreign transactions. "
    "Answer in JSON: a verdict, a risk from 0 to 10, and reasons that each quote a "
    "fact of the claim."
)
MODEL_NAME = "smollm2"
MAX_SEQS = 8  # requests the server decodes together (vLLM's --max-num-seqs)


def _max_seqs(prompts: list[str]) -> int:
    return max(1, min(len(prompts), MAX_SEQS))


def _prompt(c: dict, score: float) -> str:
    """The claim's facts as short sentences (a small model reads them better than JSON)."""
    share = 100 * c["claim_amount"] / max(c["last_claim_amount"], 0.01)
    tx = "; ".join(
        f"${t['amount']:,.2f} {t['hours_since_previous']:g} h later"
        + (" online" if t["online"] else "")
        + (" abroad" if t["foreign"] else "")
        for t in c["last_6_transactions"]
    )
    return (
        f"Screening score {score:.2f}. Claim of ${c['claim_amount']:,.2f}, "
        f"{c['policy_age_days']} days after the policy started. Claimant aged "
        f"{c['claimant_age']}, {c['prior_claims']} prior claims; the last one "
        f"{c['days_since_last_claim']} days ago for ${c['last_claim_amount']:,.2f} "
        f"(this claim is {share:.0f}% of it). Last 6 card transactions: {tx}."
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read()[:2000].decode()}") from None


def _metric(url: str, name: str) -> float | None:
    """A series of the worker's Prometheus metrics (the modelled device time, the
    op calls by path), by its name with labels, e.g. ``spyre:op_calls{path="fallback"}``."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def _budget(folder: str, prompts: list[str]) -> int:
    """The token bucket a whole prompt prefills in (the server's token budget):
    only it and the decode bucket (16) are compiled at start-up."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    longest = 0
    for p in prompts:
        ids = tok.apply_chat_template(_messages(p), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        longest = max(longest, len(ids))
    bucket = 64
    while bucket < longest:
        bucket *= 2
    if bucket > 1024:
        raise ValueError(f"a prompt of {longest} tokens is longer than the 1024-token context")
    return bucket


def serve_and_ask(
    folder: str, prompts: list[str], max_tokens: int, startup_timeout: float, dtype: str
) -> tuple[list[str], dict]:
    """Start ``vllm serve`` on the card, ask each prompt through /v1/chat/completions
    with the verdict schema; returns the answers and the stats."""
    budget = _budget(folder, prompts)
    max_seqs = _max_seqs(prompts)
    port, metrics_port = _free_port(), _free_port()
    log = tempfile.NamedTemporaryFile(prefix="fraud_triage_vllm_", suffix=".log", delete=False)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TORCH_SPYRE_VLLM_METRICS_PORT": str(metrics_port),
        # two token buckets, both warmed at start-up: decode steps (up to
        # MAX_SEQS tokens) pad to 16, every step with a prefill chunk to the
        # budget, so concurrent requests never compile a third bucket mid-run
        "TORCH_SPYRE_VLLM_BUCKETS": f"16,{budget}",
        "TORCH_SPYRE_VLLM_WARMUP": "all",
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", folder,
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL_NAME,
        "--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", str(max_seqs),
        "--max-num-batched-tokens", str(budget), "--kv-cache-memory-bytes", str(64 << 20),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"

    def tail() -> str:
        with open(log.name, errors="replace") as f:
            return f.read()[-4000:]

    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm serve was not healthy after {startup_timeout:.0f} s "
                    f"(--startup-timeout); log {log.name}:\n{tail()}"
                )
            time.sleep(1)
        startup = time.perf_counter() - t0
        before = _metric(metrics, "spyre:modelled_device_seconds_total")
        paths = ("kernel", "adapter", "fallback", "degraded")
        calls0 = {p: _metric(metrics, f'spyre:op_calls{{path="{p}"}}') for p in paths}

        def ask(p: str) -> tuple[str, float, tuple[int, int]]:
            w = time.perf_counter()
            body = {
                "model": MODEL_NAME,
                "messages": _messages(p),
                "max_tokens": max_tokens,
                "temperature": 0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA, "strict": True},
                },
            }
            out = _post(base + "/v1/chat/completions", body, timeout=600)
            use = out.get("usage") or {}
            return (
                out["choices"][0]["message"]["content"],
                time.perf_counter() - w,
                (use.get("prompt_tokens", 0), use.get("completion_tokens", 0)),
            )

        # the claims go to the server at once, as a client of a server would send
        # them: vLLM batches their decode steps (up to --max-num-seqs at a time)
        w_all = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max_seqs) as pool:
            got = list(pool.map(ask, prompts))
        requests_wall = time.perf_counter() - w_all
        answers = [a for a, _, _ in got]
        walls = [w for _, w, _ in got]
        tokens = [t for _, _, t in got]
        after = _metric(metrics, "spyre:modelled_device_seconds_total")
        modelled = after - before if before is not None and after is not None else None
        # the worker's op calls by how they were served (runtime.dispatch_stats,
        # the plugin's spyre:op_calls gauge): during the requests, and since start-up
        calls1 = {p: _metric(metrics, f'spyre:op_calls{{path="{p}"}}') for p in paths}
        during = {p: int(calls1[p] - (calls0[p] or 0)) for p in paths if calls1[p] is not None}
        return answers, {
            "op_calls": during or None,
            "op_calls_since_startup": {p: int(v) for p, v in calls1.items() if v is not None}
            or None,
            "api": "OpenAI /v1/chat/completions (vllm serve)",
            "token_budget": budget,
            "startup_wall_s": startup,
            "wall_s_per_claim": walls,
            "requests_wall_s": requests_wall,
            "tokens": tokens,  # (prompt, answer) per claim
            "modelled_s": modelled,
            "log": log.name,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def offline_ask(folder: str, prompts: list[str], max_tokens: int, dtype: str):
    """The same through vLLM's offline ``LLM`` API (no HTTP server)."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    budget = _budget(folder, prompts)
    # the engine in this process: the card's modelled clock is read here
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TORCH_SPYRE_VLLM_BUCKETS"] = f"16,{budget}"
    os.environ["TORCH_SPYRE_VLLM_WARMUP"] = "all"
    t0 = time.perf_counter()
    llm = LLM(model=folder, dtype=dtype, max_model_len=1024, max_num_seqs=_max_seqs(prompts),
              max_num_batched_tokens=budget, kv_cache_memory_bytes=64 << 20)  # fmt: skip
    startup = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=VERDICT_SCHEMA),
    )
    w = time.perf_counter()
    clock = torch.spyre.modelled_time_s()
    conv = [_messages(p) for p in prompts]
    outs = llm.chat(conv, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs], {
        "api": "vllm.LLM.chat (offline)",
        "startup_wall_s": startup,
        "wall_s_per_claim": [(time.perf_counter() - w) / max(len(prompts), 1)] * len(prompts),
        "requests_wall_s": time.perf_counter() - w,
        "tokens": [(len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for o in outs],
        "modelled_s": torch.spyre.modelled_time_s() - clock,
        "log": None,
    }


def parse_verdict(text: str) -> dict:
    """The answer as a dict, validated against ``VERDICT_SCHEMA`` (raises if not)."""
    import jsonschema

    d = json.loads(text)
    jsonschema.validate(d, VERDICT_SCHEMA)
    return d


# ----------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", type=int, default=2000, help="claims generated")
    ap.add_argument("--steps", type=int, default=16, help="transactions per claimant")
    ap.add_argument("--flagged", type=int, default=5, help="flagged claims sent to the LLM")
    ap.add_argument("--batch", type=int, default=128, help="claims per compiled batch")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="stage 1 on the card")
    ap.add_argument(
        "--lstm-programs",
        action="store_true",
        help="stage 1: Dynamo's default graph break at the LSTM, which runs as the device's "
        "recurrent programs (default: one compiled graph, the LSTM unrolled)",
    )
    ap.add_argument("--llm-dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--max-tokens", type=int, default=160, help="LLM answer budget")
    ap.add_argument("--offline", action="store_true", help="vllm.LLM instead of vllm serve")
    ap.add_argument("--no-llm", action="store_true", help="stage 1 only")
    ap.add_argument(
        "--gemma4",
        action="store_true",
        help="also plan stage 2 with Gemma 4 26B-A4B (spyre estimate at these requests' "
        "lengths; ~1 min wall)",
    )
    ap.add_argument(
        "--claims-per-second",
        type=float,
        default=CLAIMS_PER_SECOND,
        help="the stated load: claims arriving per second (cards needed with the real LLM)",
    )
    ap.add_argument(
        "--serve-tp",
        default="1,2",
        help="TP sizes planned by spyre estimate --serve per model (1,2,4: ~3 more min cold)",
    )
    ap.add_argument("--no-cards", action="store_true", help="skip the cards-needed plans")
    ap.add_argument("--plot", default="fraud_triage_cards.png", help="throughput vs cards PNG")
    ap.add_argument("--startup-timeout", type=float, default=600, help="vllm serve health wait")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.claims < 50 or args.batch < 1:
        ap.error("--claims must be at least 50 and --batch at least 1")
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    wall0 = time.perf_counter()
    res: dict = {"claims": args.claims, "batch": args.batch, "dtype": args.dtype}

    # -- data and training (CPU)
    data = make_claims(args.claims, args.steps, args.seed)
    perm = torch.randperm(args.claims, generator=torch.Generator().manual_seed(args.seed + 1))
    n_train = int(0.7 * args.claims)
    tr, te = perm[:n_train], perm[n_train:]
    t = time.perf_counter()
    model = train(data, tr, args.epochs, args.seed)
    res["train_wall_s"] = time.perf_counter() - t
    print(
        f"claims: {args.claims} ({int(data.label.sum())} fraud, planted: "
        + ", ".join(f"{p} {sum(p in q for q in data.pattern)}" for p in PATTERNS)
        + f"); {len(tr)} train, {len(te)} held out"
    )
    print(
        f"stage 1: MLP ({len(TAB_FEATURES)} tabular features) + LSTM ({args.steps} transactions x "
        f"{len(SEQ_FEATURES)}), trained on the CPU in {res['train_wall_s']:.1f} s"
    )
    with torch.no_grad():
        cpu = model(data.tab, data.seq)

    # -- stage 1 on the card
    card, st = score_on_card(model, data, args.batch, dtype, whole_graph=not args.lstm_programs)
    diff = float((card - cpu).abs().max())
    flips = int(((card > 0.5) != (cpu > 0.5)).sum())
    prec, rec = precision_recall(card[te], data.label[te])
    cprec, crec = precision_recall(cpu[te], data.label[te])
    res.update(
        stage1=st,
        max_diff=diff,
        decision_flips=flips,
        precision=prec,
        recall=rec,
        cpu_precision=cprec,
        cpu_recall=crec,
    )
    per_1000 = st["modelled_s_per_batch"] / args.batch * 1000
    print(
        f"  on the card ({args.dtype}, torch.compile"
        + (", LSTM as recurrent programs" if args.lstm_programs else ", one graph")
        + f", batches of {args.batch}): "
        f"{st['batches']} batches; max |card - CPU| score {diff:.2e}, {flips} decisions differ"
    )
    print(
        f"  host fallbacks: {st['host_fallbacks']} {st['fallback_ops'] or ''}; ops served: "
        + ", ".join(f"{p} {n}" for p, n in st["paths"].items())
    )
    print(
        f"  held-out precision {prec:.3f}, recall {rec:.3f} (CPU: {cprec:.3f}, {crec:.3f}) "
        f"at threshold 0.5"
    )
    print(
        f"  modelled card time: {st['modelled_s_per_batch'] * 1e3:.3f} ms per batch of "
        f"{args.batch} ({per_1000 * 1e3:.2f} ms per 1,000 claims); wall here "
        f"{st['wall_s_first_batch']:.1f} s for the first batch (compiling), "
        f"{st['wall_s_per_batch_warm']:.2f} s per batch after"
    )
    res["stage1_modelled_s_per_1000"] = per_1000

    # -- stage 2: the flagged held-out claims, highest score first
    flagged = [
        int(i) for i in te[card[te] > 0.5][card[te][card[te] > 0.5].argsort(descending=True)]
    ]
    chosen = flagged[: args.flagged]
    res["flagged_held_out"] = len(flagged)
    print(f"stage 2: {len(flagged)} held-out claims flagged; {len(chosen)} go to the LLM")
    share = len(flagged) / len(te)
    if args.no_llm or not chosen:
        _cards(args, res, share, None)
        res["wall_s"] = time.perf_counter() - wall0
        print(f"wall time: {res['wall_s']:.0f} s in all")
        _write(args.json, res)
        return res
    from torch_spyre.models.offline import folder

    path = str(folder("smollm2"))
    prompts = [_prompt(data.raw[i], float(card[i])) for i in chosen]
    if args.offline:
        answers, st2 = offline_ask(path, prompts, args.max_tokens, args.llm_dtype)
    else:
        answers, st2 = serve_and_ask(
            path, prompts, args.max_tokens, args.startup_timeout, args.llm_dtype
        )
    verdicts = []
    for i, text in zip(chosen, answers, strict=True):
        try:
            v = parse_verdict(text)
            err = None
        except Exception as e:  # reported, and counted as a failed verdict
            v, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        verdicts.append(
            {
                "claim": i,
                "score": float(card[i]),
                "truth": "fraud" if data.label[i] > 0.5 else "legitimate",
                "planted": data.pattern[i],
                "answer": text,
                "verdict": v,
                "error": err,
            }
        )
    res.update(stage2=st2, verdicts=verdicts)
    modelled = st2["modelled_s"]
    print(
        f"  SmolLM2-135M-Instruct on the card via {st2['api']}, structured output (JSON schema); "
        f"{'engine' if args.offline else 'server'} up in {st2['startup_wall_s']:.0f} s wall"
    )
    for v in verdicts:
        head = (
            f"  claim {v['claim']} (score {v['score']:.2f}, truth {v['truth']}"
            + (f": {', '.join(v['planted'])}" if v["planted"] else "")
            + ")"
        )
        if v["verdict"] is None:
            print(f"{head}: NOT a valid verdict ({v['error']}): {v['answer'][:200]!r}")
        else:
            d = v["verdict"]
            print(
                f"{head}: {d['verdict']}, risk {d['risk']}, signals {', '.join(d['signals'])}: "
                + "; ".join(d["reasons"])
            )
    ok = sum(v["verdict"] is not None for v in verdicts)
    named = [set(v["verdict"]["signals"]) & set(v["planted"]) for v in verdicts if v["verdict"]]
    res["llm_fraud_verdicts"] = sum(
        v["verdict"]["verdict"] == "fraud" for v in verdicts if v["verdict"]
    )
    res["llm_signals_matching_a_planted_pattern"] = sum(bool(m) for m in named)
    walls = st2["wall_s_per_claim"]
    print(
        f"  {ok}/{len(verdicts)} answers parse against the schema; "
        + (
            f"modelled card time {modelled * 1e3:.1f} ms for the {len(verdicts)} claims "
            f"({modelled / len(verdicts) * 1e3:.1f} ms per claim); "
            if modelled is not None
            else "modelled card time not reported by the server; "
        )
        + f"wall {st2['requests_wall_s']:.1f} s for the {len(verdicts)} requests sent together "
        f"(each {min(walls):.1f}-{max(walls):.1f} s)"
    )
    calls, since = st2.get("op_calls"), st2.get("op_calls_since_startup")
    if calls:
        print(
            "  stage 2 op calls in the worker during the requests (spyre:op_calls): "
            + ", ".join(f"{p} {n}" for p, n in calls.items())
            + f"; since start-up (warm-up included): fallback {since.get('fallback')}, "
            f"degraded {since.get('degraded')}"
        )
    else:
        print("  stage 2 op calls: not reported by the worker (spyre:op_calls)")
    print(
        f"  verdict 'fraud' on {res['llm_fraud_verdicts']}/{ok}; a named signal matches a "
        f"planted pattern on {res['llm_signals_matching_a_planted_pattern']}/{ok}"
    )
    if modelled is not None:
        # per 1,000 claims: stage 1 scores all of them, stage 2 sees the flagged share
        res["stage2_modelled_s_per_1000"] = 1000 * share * modelled / len(verdicts)
        print(
            f"per 1,000 claims, modelled on one card: stage 1 {per_1000 * 1e3:.2f} ms; stage 2 "
            f"{res['stage2_modelled_s_per_1000']:.1f} s with SmolLM2 ({share:.1%} flagged)"
        )
        if args.gemma4:
            res["gemma4"] = _gemma4_per_claim(st2["tokens"], share)
    _cards(args, res, share, st2["tokens"])
    res["wall_s"] = time.perf_counter() - wall0
    print(f"wall time: {res['wall_s']:.0f} s in all")
    _write(args.json, res)
    return res


def _gemma4_per_claim(tokens: list[tuple[int, int]], share: float) -> dict:
    """Stage 2 with the real model: ``spyre estimate gemma-4-26b-a4b`` planned at
    these requests' prompt and answer lengths (SmolLM2's token counts: the
    Gemma tokenizer's differ), batch 1 on one card."""
    from torch_spyre.models.estimate import estimate

    prompt = max(p for p, _ in tokens)
    answer = sum(a for _, a in tokens) / len(tokens)
    prompt = -(-prompt // 64) * 64  # the estimate's 64-token buckets
    t = time.perf_counter()
    est = estimate("gemma-4-26b-a4b", prompt=prompt, new_tokens=max(a for _, a in tokens))
    per_claim = est.prefill_s + answer * est.decode_s
    out = {
        "prompt_tokens": prompt,
        "answer_tokens_mean": answer,
        "prefill_s": est.prefill_s,
        "decode_s_per_token": est.decode_s,
        "modelled_s_per_claim": per_claim,
        "modelled_s_per_1000_claims": 1000 * share * per_claim,
        "host_fallbacks": est.host_fallbacks,
        "plan_wall_s": time.perf_counter() - t,
    }
    print(
        f"  Gemma 4 26B-A4B instead (spyre estimate, one card, batch 1): prefill of {prompt} "
        f"tokens {est.prefill_s * 1e3:.1f} ms + {answer:.0f} tokens x "
        f"{est.decode_s * 1e3:.1f} ms = {per_claim:.2f} s per claim, "
        f"{out['modelled_s_per_1000_claims']:.0f} s per 1,000 claims "
        f"(planned in {out['plan_wall_s']:.0f} s wall; {est.host_fallbacks} host fallbacks in "
        "the plan: docs/models.md)"
    )
    return out


#: the stated load (``--claims-per-second``): claims arriving per second
CLAIMS_PER_SECOND = 5.0
#: per-claim LLM tokens when stage 2 did not run (``--no-llm``): the measured
#: SmolLM2 requests' means at the default sizes (docs/use-case.md)
DEFAULT_TOKENS = (256, 107)
#: the real LLMs of the cards-needed table: (``spyre estimate`` name, label)
SERVE_MODELS = (("gemma-4-26b-a4b", "Gemma 4 26B-A4B"), ("granite-3.3-8b", "Granite-3.3-8B"))
SERVE_BATCH = 32  # vLLM's max_num_seqs in the serve plans (spyre estimate --serve's default)
MAX_CARDS = 8  # cards in a Spyre system


def _capacity(model: str, tp: int, input_len: int, output_len: int) -> dict:
    """Requests/s one ``tp``-card instance of ``model`` serves at saturation:
    ``spyre estimate MODEL --serve`` (vLLM's scheduler over the planned batch-1
    and batch-32 step times) at an offered rate far above it.  Deterministic,
    so cached beside Inductor's cache (TORCHINDUCTOR_CACHE_DIR, else
    ~/.cache/torch_spyre), keyed by the inputs and a hash of the
    torch_spyre sources and the card's hardware config."""
    import hashlib

    import torch_spyre
    from torch_spyre.models import estimate, serve_plan

    src = os.path.dirname(torch_spyre.__file__)
    h = hashlib.sha256(repr((model, tp, input_len, output_len, SERVE_BATCH)).encode())
    for d, _, files in sorted(os.walk(src)):
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(fh.read())
    # the card's model (TORCH_SPYRE_* hardware settings), not the whole
    # environment (the run sets per-process values, ports, in it)
    from torch_spyre.hardware import HardwareConfig
    from torch_spyre.runtime import cards

    h.update(repr((HardwareConfig.from_env(), cards.config())).encode())
    # beside Inductor's compiled code: a fresh TORCHINDUCTOR_CACHE_DIR is a cold run
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser("~/.cache/torch_spyre")
    cache = os.path.join(root, "spyre_serve_plans", h.hexdigest()[:24])
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f) | {"cached": True}
    cfg = estimate.model_config(model)
    common = dict(prompt=input_len, new_tokens=output_len, config=cfg, tp=tp)
    one = estimate.estimate(model, batch=1, **common)
    many = estimate.estimate(model, batch=SERVE_BATCH, **common)
    out = {"model": model, "tp": tp, "fits": bool(many.fits), "host_fallbacks": many.host_fallbacks}
    if many.fits:
        plan = serve_plan.plan(
            one, many, cfg, rate=1000.0, input_len=input_len, output_len=output_len, requests=96
        )
        out.update(
            requests_s=plan.throughput_requests_s,
            tokens_s=plan.throughput_tokens_s,
            tpot_p50_s=plan.pct(plan.tpot_s, 50),
            decode_1_s=one.decode_s,
            decode_batch_s=many.decode_s,
        )
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "w") as f:
        json.dump(out, f)
    return out | {"cached": False}


def _cards(args, res: dict, share: float, tokens: list[tuple[int, int]] | None) -> None:
    """How many cards the stated claims-per-second load needs with the real
    LLM, from ``spyre estimate --serve``, and the throughput-vs-cards PNG."""
    if args.no_cards:
        return
    if tokens:
        input_len = -(-max(p for p, _ in tokens) // 64) * 64  # the estimate's 64-token buckets
        output_len = round(sum(a for _, a in tokens) / len(tokens))
    else:
        input_len, output_len = DEFAULT_TOKENS
    load = args.claims_per_second
    rate = load * share  # LLM requests per second
    tps = [int(t) for t in str(args.serve_tp).split(",") if t.strip()]
    t0 = time.perf_counter()
    print(
        f"cards for {load:g} claims/s with the real LLM: {share:.1%} flagged -> {rate:.3f} LLM "
        f"requests/s of {input_len} in / {output_len} out tokens (spyre estimate --serve, "
        f"batch {SERVE_BATCH}, fp16, TP {', '.join(map(str, tps))}; replicas of one TP size "
        "for more)"
    )
    print(f"  {'model':<16} {'TP':>3} {'req/s per instance':>19} {'claims/s':>9} {'TPOT p50':>9}"
          f" {'instances':>9} {'cards':>6}")  # fmt: skip
    table, curves = [], {}
    for model, label in SERVE_MODELS:
        caps = {}
        for tp in tps:
            try:
                c = _capacity(model, tp, input_len, output_len)
            except (ValueError, NotImplementedError) as e:
                print(f"  {label:<16} {tp:>3}  not planned: {e}")
                continue
            if not c["fits"]:
                print(f"  {label:<16} {tp:>3}  does not fit at batch {SERVE_BATCH}")
                continue
            caps[tp] = c
            inst = max(1, math.ceil(rate / c["requests_s"] - 1e-9))
            row = {
                "model": model, "tp": tp, "requests_s_per_instance": c["requests_s"],
                "claims_s_per_instance": c["requests_s"] / share if share else math.inf,
                "tpot_p50_s": c["tpot_p50_s"], "instances": inst, "cards": inst * tp,
                "host_fallbacks_in_plan": c["host_fallbacks"],
            }  # fmt: skip
            table.append(row)
            print(
                f"  {label:<16} {tp:>3} {c['requests_s']:>19.3f} {row['claims_s_per_instance']:>9.2f}"
                f" {c['tpot_p50_s'] * 1e3:>7.0f}ms {inst:>9} {inst * tp:>6}"
            )
        # throughput (claims/s) on n cards: the best split of n into replicas of one TP size
        curves[label] = [
            max([(n // tp) * c["requests_s"] / share for tp, c in caps.items() if n >= tp] or [0.0])
            for n in range(1, MAX_CARDS + 1)
        ]
        falls = {c["host_fallbacks"] for c in caps.values()}
        if falls - {0}:
            print(
                f"  ({label}'s plans have {max(falls)} host fallbacks: its prefill's grouping of "
                "the routed slots, docs/models.md)"
            )
        best = min(
            (r for r in table if r["model"] == model), key=lambda r: r["cards"], default=None
        )
        if best:
            print(
                f"  -> {label}: {best['cards']} card(s) for {load:g} claims/s "
                f"({best['instances']} x TP {best['tp']})"
            )
    res["cards"] = {
        "claims_per_second": load, "flagged_share": share, "llm_requests_s": rate,
        "input_len": input_len, "output_len": output_len, "table": table,
        "claims_s_by_cards": curves, "plan_wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    if args.plot and curves:
        _plot(curves, load, args.plot)
        res["cards"]["plot"] = args.plot
        print(f"  throughput vs cards: wrote {args.plot}")


def _plot(curves: dict[str, list[float]], load: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = list(range(1, MAX_CARDS + 1))
    for label, ys in curves.items():
        ax.plot(n, ys, "o-", label=label)
    ax.axhline(load, color="grey", ls=":", label=f"stated load {load:g} claims/s")
    ax.set_xlabel("Spyre cards")
    ax.set_ylabel("claims per second (modelled)")
    ax.set_title("Fraud triage, stage 2 on N cards (spyre estimate --serve)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _write(path: str | None, res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {path}")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
