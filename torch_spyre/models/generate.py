"""A generation loop for causal LMs on spyre: prefill, then decode through a static KV cache.

The KV cache is transformers' ``StaticCache``: fixed-size key/value tensors
allocated in device memory once and updated in place.  Every input has one
shape per bucket, so a compiled model (``prepare(compile=True)``) compiles
once for the prefill bucket and once for decoding, never per step:

* the prompt is right-padded to a multiple of ``prefill_bucket`` tokens.
  Causal attention keeps the real tokens blind to the padding; the padding
  writes cache slots past the prompt, and each decode step overwrites its
  slot before it attends to it (and never sees later slots);
* the attention mask always covers the whole cache (``cache_len``
  positions, a multiple of ``bucket``): slots are switched on as tokens are
  produced, so left-padded batches (validation) keep one shape too.

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

from torch_spyre.models import layer_regions


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch, new tokens), on the host
    prefill_tokens: int
    cache_len: int
    prefill_wall_s: float
    prefill_modelled_s: float
    decode_wall_s: list[float] = field(default_factory=list)  # per step
    decode_modelled_s: list[float] = field(default_factory=list)
    #: with ``keep_logits``: the logits each token was picked from (host fp32,
    #: [batch, vocab] per token)
    logits: list[torch.Tensor] = field(default_factory=list)

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


def prompt_ids(tokenizer, text: str, chat: bool = True) -> torch.Tensor:
    """Token ids (1, n) of ``text``: as one user turn of the tokenizer's chat
    template (with the assistant's turn opened) when it has one and ``chat``,
    else the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    eos_token_id: int | None = None,
    bucket: int = 64,
    prefill_bucket: int = 16,
    progress: bool = False,
    keep_logits: bool = False,
    force_tokens: torch.Tensor | None = None,
) -> Generation:
    """Generate for a batch of prompts (``input_ids`` (batch, seq), host tensor;
    ``attention_mask`` marks left padding, as a tokenizer with
    ``padding_side="left"`` returns it).

    Stops early when every row has produced ``eos_token_id``.  ``keep_logits``
    keeps the logits of every step (host fp32).  ``force_tokens`` (batch,
    max_new_tokens): feed these tokens instead of the picked ones (teacher
    forcing through the cache: a 16-bit run compared step by step with a
    reference's tokens); ``tokens`` are still the picks.
    """
    from transformers import StaticCache

    device = next(model.parameters()).device
    batch, n = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    n_pad = _round_up(n, prefill_bucket)
    cache_len = _round_up(n_pad + max_new_tokens, bucket)
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    # a compiled model's layers take their cache tensors as region inputs
    # (models/layer_regions.py): allocated now, not inside the first graph
    layer_regions.allocate(model, cache, batch)
    if n_pad > n and not all(getattr(layer, "is_croppable", True) for layer in cache.layers):
        # a sliding-window layer shorter than the cache cannot take the padding
        # back (it may have pushed real tokens out): prefill unpadded
        n_pad = n
    # positions count real tokens only (left padding); padding continues them
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    extra = torch.arange(1, n_pad - n + 1).expand(batch, -1)
    pos_pad = torch.cat([pos, pos[:, -1:] + extra], dim=-1)
    ids_pad = torch.cat([input_ids, input_ids[:, -1:].expand(batch, n_pad - n)], dim=-1)
    full_mask = torch.zeros(batch, cache_len, dtype=torch.long)
    full_mask[:, :n] = mask
    gen = torch.Generator().manual_seed(seed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="decode", unit="tok")
    with torch.no_grad():
        t_mod, t_wall = _clock(device), time.perf_counter()
        out = model(
            input_ids=ids_pad.to(device),
            attention_mask=full_mask.to(device),
            position_ids=pos_pad.to(device),
            cache=cache,
            cache_position=torch.arange(n_pad).to(device),
            use_cache=True,
        )
        if n_pad > n:
            # the cache writes where its layers' counters say (transformers 5):
            # step them back so the first decode step overwrites the padding
            for layer in out.cache.layers:
                layer.crop(n - n_pad)
        last = out.logits[:, n - 1]
        nxt = _pick(last, do_sample, temperature, top_k, gen)
        result = Generation(
            tokens=nxt,
            prefill_tokens=n,
            cache_len=cache_len,
            prefill_wall_s=time.perf_counter() - t_wall,
            prefill_modelled_s=_clock(device) - t_mod,
        )
        if keep_logits:
            result.logits.append(last.to("cpu", torch.float32))
        toks = [nxt]
        done = torch.zeros(batch, dtype=torch.bool)
        last = pos[:, -1:]
        for step in range(max_new_tokens - 1):
            if bar is not None:
                bar.update(1)
            if eos_token_id is not None and force_tokens is None:
                done |= nxt[:, 0] == eos_token_id
                if bool(done.all()):
                    break
            full_mask[:, n + step] = 1
            fed = nxt if force_tokens is None else force_tokens[:, step : step + 1]
            t_mod, t_wall = _clock(device), time.perf_counter()
            out = model(
                input_ids=fed.to(device),
                attention_mask=full_mask.to(device),
                position_ids=(last + 1 + step).to(device),
                cache=out.cache,
                cache_position=torch.tensor([n + step]).to(device),
                use_cache=True,
            )
            nxt = _pick(out.logits[:, -1], do_sample, temperature, top_k, gen)
            result.decode_wall_s.append(time.perf_counter() - t_wall)
            result.decode_modelled_s.append(_clock(device) - t_mod)
            if keep_logits:
                result.logits.append(out.logits[:, -1].to("cpu", torch.float32))
            toks.append(nxt)
    if bar is not None:
        bar.close()
    result.tokens = torch.cat(toks, dim=-1)
    return result
