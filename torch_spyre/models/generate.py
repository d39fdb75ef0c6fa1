"""A generation loop for causal LMs on spyre: prefill, then decode through a static KV cache.

The KV cache is transformers' ``StaticCache``: fixed-size key/value tensors
allocated in device memory once and updated in place, so every decode step
has the same shapes (the property the compiled path needs to build one graph
per shape bucket; the cache length is rounded up to ``bucket`` tokens).  The
loop runs on the eager path today (``prepare(compile=False)``).

Sampling happens on the host from the last logits (a few hundred KB per
step), with a seeded generator: greedy and sampled runs are reproducible.
Modelled device time (``torch.spyre.modelled_time_s``) is reported next to
wall time, separately for the prefill and per decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch, new tokens), on the host
    prefill_tokens: int
    cache_len: int
    prefill_wall_s: float
    prefill_modelled_s: float
    decode_wall_s: list[float] = field(default_factory=list)  # per step
    decode_modelled_s: list[float] = field(default_factory=list)

    @property
    def decode_ms_per_token(self) -> tuple[float, float]:
        """(modelled, wall) mean ms per decode step."""
        n = max(len(self.decode_wall_s), 1)
        return 1e3 * sum(self.decode_modelled_s) / n, 1e3 * sum(self.decode_wall_s) / n

    def summary(self) -> str:
        mod, wall = self.decode_ms_per_token
        return (
            f"prefill {self.prefill_tokens} tokens: modelled {self.prefill_modelled_s * 1e3:.2f} ms"
            f" (wall {self.prefill_wall_s:.2f} s); decode {len(self.decode_wall_s)} steps: "
            f"modelled {mod:.3f} ms/token (wall {wall / 1e3:.2f} s/token); "
            f"static cache {self.cache_len} positions"
        )


def _clock(device: torch.device) -> float:
    return torch.spyre.modelled_time_s() if device.type == "spyre" else 0.0


def _pick(
    logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, gen
) -> torch.Tensor:
    logits = logits.to("cpu", torch.float32)
    if not do_sample:
        return logits.argmax(-1, keepdim=True)
    logits = logits / max(temperature, 1e-6)
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    eos_token_id: int | None = None,
    bucket: int = 64,
    progress: bool = False,
) -> Generation:
    """Generate for a batch of equal-length prompts (``input_ids`` (batch, seq), host tensor).

    Stops early when every row has produced ``eos_token_id``.
    """
    from transformers import StaticCache

    device = next(model.parameters()).device
    batch, n = input_ids.shape
    # round the cache length up to a bucket: one shape per bucket for the compiled path
    cache_len = -(-(n + max_new_tokens) // bucket) * bucket
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    gen = torch.Generator().manual_seed(seed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="decode", unit="tok")
    with torch.no_grad():
        t_mod, t_wall = _clock(device), time.perf_counter()
        out = model(
            input_ids=input_ids.to(device),
            cache=cache,
            cache_position=torch.arange(n).to(device),
            use_cache=True,
        )
        nxt = _pick(out.logits[:, -1], do_sample, temperature, top_k, gen)
        result = Generation(
            tokens=nxt,
            prefill_tokens=n,
            cache_len=cache_len,
            prefill_wall_s=time.perf_counter() - t_wall,
            prefill_modelled_s=_clock(device) - t_mod,
        )
        toks = [nxt]
        done = torch.zeros(batch, dtype=torch.bool)
        for step in range(max_new_tokens - 1):
            if bar is not None:
                bar.update(1)
            if eos_token_id is not None:
                done |= nxt[:, 0] == eos_token_id
                if bool(done.all()):
                    break
            t_mod, t_wall = _clock(device), time.perf_counter()
            out = model(
                input_ids=nxt.to(device),
                cache=out.cache,
                cache_position=torch.tensor([n + step]).to(device),
                use_cache=True,
            )
            nxt = _pick(out.logits[:, -1], do_sample, temperature, top_k, gen)
            result.decode_wall_s.append(time.perf_counter() - t_wall)
            result.decode_modelled_s.append(_clock(device) - t_mod)
            toks.append(nxt)
    if bar is not None:
        bar.close()
    result.tokens = torch.cat(toks, dim=-1)
    return result
